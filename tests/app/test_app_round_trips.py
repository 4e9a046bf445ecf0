"""What real clients send next: the assistant message they got back goes into the history as they return it,
null means the default where OpenAI allows null, and keys clients add inside messages are ignored."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessage

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, ERROR_KEYS, MODEL


def history(assistant: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Hi"}, assistant, {"role": "user", "content": "And then?"}]


OPENAI_REPLY = ChatCompletionMessage(role="assistant", content="Hello, world").model_dump()
ROUND_TRIPS = {
    "openai model_dump": OPENAI_REPLY,
    "openai model_dump without nulls": ChatCompletionMessage(role="assistant", content="Hello").model_dump(
        exclude_none=True
    ),
    "tool_calls empty": {"role": "assistant", "content": "Hello", "tool_calls": []},
    "refusal and annotations": {"role": "assistant", "content": "Hello", "refusal": None, "annotations": []},
    "litellm message": {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": None,
        "function_call": None,
        "provider_specific_fields": {"refusal": None},
    },
}


@pytest.mark.parametrize("assistant", list(ROUND_TRIPS.values()), ids=list(ROUND_TRIPS))
async def test_the_second_turn_of_a_round_trip_succeeds(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any, assistant: dict[str, Any]
) -> None:
    response = await client.post(CHAT, json={"model": MODEL, "messages": history(assistant), "max_tokens": 3})
    assert response.status_code == 200, response.text
    rendered = hf_tokenizer.decode(fake.submitted[0].prompt_token_ids)
    assert "Hello" in rendered and "And then?" in rendered  # the history reached the model, its extras did not
    assert "provider_specific_fields" not in rendered and "refusal" not in rendered


async def test_a_text_part_with_an_extra_key_is_taken(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    part = {"type": "text", "text": "Hi there", "cache_control": {"type": "ephemeral"}}
    response = await client.post(
        CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 3}
    )
    assert response.status_code == 200, response.text


async def test_legacy_function_calls_in_the_history_get_a_clear_400(client: httpx.AsyncClient) -> None:
    assistant = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    response = await client.post(CHAT, json={"model": MODEL, "messages": history(assistant)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages.1.function_call" and "tool_calls" in error["message"]


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {"n": None, "stream": None, "logprobs": None}),
        (COMPLETIONS, {"n": None, "stream": None, "logprobs": None, "echo": None}),
    ],
    ids=["chat", "completions"],
)
async def test_null_means_the_default(
    client: httpx.AsyncClient, fake: FakeEngine, path: str, fields: dict[str, None]
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, **fields}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert len(fake.submitted) == 1 and fake.submitted[0].params.logprobs is None


async def test_unknown_top_level_fields_still_get_their_400(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "x": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x"


async def test_json_without_a_json_content_type_is_told_so(client: httpx.AsyncClient) -> None:
    response = await client.post(
        CHAT, content=b'{"model": "fake-model", "messages": []}', headers={"content-type": "text/plain"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "invalid_content_type" and "Content-Type" in error["message"]
