"""The responses store stays within its count and its bytes (UTF-8 JSON), least recently used out first, and
shows each response only to the key that stored it."""

from __future__ import annotations

import json

from transformers_openai.protocol import ChatMessage
from transformers_openai.protocol.responses import ResponseObject
from transformers_openai.serving.text.response_store import ResponseStore, StoredResponse, owner_of_key, stored_bytes

ALICE, BOB = owner_of_key("key-a"), owner_of_key("key-b")


def entry(response_id: str, text_chars: int, char: str = "x", owner: str | None = None) -> StoredResponse:
    response = ResponseObject(id=response_id, status="completed", model="m")
    return StoredResponse(response, (ChatMessage(role="user", content=char * text_chars),), owner)


def test_the_least_recently_used_go_first_by_count() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(entry(name, 10))
    assert store.get("a", None) is not None  # a is now the most recently used
    store.put(entry("c", 10))
    assert store.get("b", None) is None and store.get("a", None) is not None and store.get("c", None) is not None


def test_bytes_are_bounded_and_given_back() -> None:
    one = stored_bytes(entry("a", 1000))
    store = ResponseStore(capacity=100, max_bytes=2 * one + one // 2)
    for name in ("a", "b", "c"):
        store.put(entry(name, 1000))
    assert len(store) == 2 and store.get("a", None) is None
    assert store.bytes == 2 * one
    assert store.delete("b", None) and store.bytes == one
    store.put(entry("c", 1000))  # stored again under the same id: counted once
    assert len(store) == 1 and store.bytes == one


def test_text_beyond_ascii_counts_as_its_utf8_bytes() -> None:
    """A character of CJK text is 3 bytes of UTF-8 and an emoji 4: a budget in characters would let such text take
    3-4x what it allows."""
    ascii_entry, cjk, emoji = entry("a", 1000), entry("b", 1000, "語"), entry("c", 1000, "🙂")
    assert stored_bytes(cjk) - stored_bytes(ascii_entry) == 2 * 1000
    assert stored_bytes(emoji) - stored_bytes(ascii_entry) == 3 * 1000
    message = cjk.conversation[0]
    assert stored_bytes(cjk) == len(cjk.response.model_dump_json().encode()) + len(message.model_dump_json().encode())
    assert json.loads(message.model_dump_json())["content"] == "語" * 1000  # kept as text, not as escapes
    # Room for three ASCII entries holds one CJK entry of as many characters, not two (nor three).
    assert stored_bytes(ascii_entry) < 2000
    store = ResponseStore(capacity=100, max_bytes=3 * stored_bytes(ascii_entry))
    store.put(entry("d", 1000, "語"))
    store.put(entry("e", 1000, "語"))
    assert len(store) == 1 and store.get("e", None) is not None
    assert store.bytes == stored_bytes(entry("e", 1000, "語")) <= store.max_bytes


def test_an_entry_larger_than_the_store_is_not_kept_and_evicts_nothing() -> None:
    store = ResponseStore(capacity=10, max_bytes=stored_bytes(entry("a", 100)) + 10)
    store.put(entry("a", 100))
    store.put(entry("huge", 10_000))
    assert store.get("huge", None) is None and store.get("a", None) is not None


def test_another_key_neither_reads_nor_deletes_a_response() -> None:
    store = ResponseStore(capacity=2)
    store.put(entry("a", 10, owner=ALICE))
    store.put(entry("b", 10, owner=ALICE))
    assert store.get("a", BOB) is None and store.get("a", None) is None
    assert not store.delete("a", BOB) and len(store) == 2
    # Bob's look did not make "a" recently used: it is the one the next entry evicts.
    store.put(entry("c", 10, owner=BOB))
    assert store.get("a", ALICE) is None and store.get("b", ALICE) is not None
    assert store.get("c", BOB) is not None and store.get("c", ALICE) is None
    assert store.delete("c", BOB) and store.get("c", BOB) is None


def test_the_owner_is_a_digest_of_the_key() -> None:
    assert owner_of_key("key-a") == owner_of_key("key-a") != owner_of_key("key-b")
    assert "key-a" not in owner_of_key("key-a") and len(owner_of_key("key-a")) == 64
