"""The responses store stays within its count and its characters, least recently used out first."""

from __future__ import annotations

from transformers_openai.protocol import ChatMessage
from transformers_openai.protocol.responses import ResponseObject
from transformers_openai.serving.response_store import ResponseStore, StoredResponse


def entry(response_id: str, text_chars: int) -> StoredResponse:
    response = ResponseObject(id=response_id, status="completed", model="m")
    return StoredResponse(response, (ChatMessage(role="user", content="x" * text_chars),))


def size(stored: StoredResponse) -> int:
    return len(stored.response.model_dump_json()) + sum(len(m.model_dump_json()) for m in stored.conversation)


def test_the_least_recently_used_go_first_by_count() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(entry(name, 10))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(entry("c", 10))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def test_characters_are_bounded_and_given_back() -> None:
    one = size(entry("a", 1000))
    store = ResponseStore(capacity=100, max_chars=2 * one + one // 2)
    for name in ("a", "b", "c"):
        store.put(entry(name, 1000))
    assert len(store) == 2 and store.get("a") is None
    assert store.chars == 2 * one
    assert store.delete("b") and store.chars == one
    store.put(entry("c", 1000))  # stored again under the same id: counted once
    assert len(store) == 1 and store.chars == one


def test_an_entry_larger_than_the_store_is_not_kept_and_evicts_nothing() -> None:
    store = ResponseStore(capacity=10, max_chars=size(entry("a", 100)) + 10)
    store.put(entry("a", 100))
    store.put(entry("huge", 10_000))
    assert store.get("huge") is None and store.get("a") is not None
