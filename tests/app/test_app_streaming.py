"""Server-sent events: role first, content deltas, finish_reason last, usage when asked, errors in-band, [DONE]."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import CHAT, COMPLETIONS, ERROR_KEYS, chat_body, completion_body, sse_chunks, sse_data


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse_chunks(response.text)


def check_choice_order(chunks: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """The chunk-choices of one index: none after the one with finish_reason, which must exist."""
    mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
    finished = [i for i, c in enumerate(mine) if c.get("finish_reason")]
    assert finished == [len(mine) - 1], mine
    return mine


async def test_chat_stream(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    chunks = await stream(client, CHAT, chat_body())
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"].get("role") is None for c in chunks[1:])
    mine = check_choice_order(chunks, 0)
    assert "".join(c["delta"].get("content") or "" for c in mine) == "Hello, world"
    assert mine[-1]["finish_reason"] == "stop"
    assert mine[-1]["delta"]["content"] == " world"  # the last content-bearing chunk carries it
    assert all(c.get("usage") is None for c in chunks)
    assert not fake.in_flight


async def test_chat_stream_include_usage(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    chunks = await stream(client, CHAT, chat_body(stream_options={"include_usage": True}))
    *content, last = chunks
    assert last["choices"] == []
    prompt_len = len(fake.submitted[0].prompt_token_ids)
    assert last["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3}
    assert all(c.get("usage") is None for c in content)
    check_choice_order(content, 0)


async def test_chat_stream_with_n(client: httpx.AsyncClient) -> None:
    chunks = await stream(client, CHAT, chat_body(n=2, stream_options={"include_usage": True}))
    for index in (0, 1):
        mine = check_choice_order(chunks[:-1], index)
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content") or "" for c in mine) == "Hello, world"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_chat_stream_logprobs(client: httpx.AsyncClient) -> None:
    chunks = await stream(client, CHAT, chat_body(logprobs=True, top_logprobs=1))
    entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 3
    assert all(len(e["top_logprobs"]) == 1 for e in entries)


async def test_completion_stream(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    chunks = await stream(client, COMPLETIONS, completion_body(stream_options={"include_usage": True}))
    *content, last = chunks
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    mine = check_choice_order(content, 0)
    assert "".join(c["text"] for c in mine) == "Hello, world"
    assert mine[-1]["finish_reason"] == "stop"
    prompt_len = len(fake.submitted[0].prompt_token_ids)
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3}


async def test_completion_stream_echo_starts_with_the_prompt(client: httpx.AsyncClient) -> None:
    chunks = await stream(client, COMPLETIONS, completion_body(echo=True))
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    assert text == "Once upon a timeHello, world"


async def test_completion_stream_length_finish(client: httpx.AsyncClient) -> None:
    chunks = await stream(client, COMPLETIONS, completion_body(max_tokens=1))
    last = check_choice_order(chunks, 0)[-1]
    assert last == {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}


async def test_engine_error_mid_stream_is_an_sse_error_event(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=["Hello", ",", " world"], error_after=1)
    response = await client.post(CHAT, json=chat_body(stream=True))
    assert response.status_code == 200  # the status line went out with the first chunk
    data = sse_data(response.text)
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    *chunks, error_event = events
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello"
    assert set(error_event) == {"error"}
    assert set(error_event["error"]) == ERROR_KEYS
    assert error_event["error"]["type"] == "server_error"
    assert "boom" in error_event["error"]["message"]
    assert not fake.in_flight


async def test_engine_error_without_streaming_is_a_500(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(error_after=0)
    response = await client.post(COMPLETIONS, json=completion_body())
    assert response.status_code == 500
    assert set(response.json()["error"]) == ERROR_KEYS


async def test_continuous_usage_stats_put_usage_so_far_on_every_chunk(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await stream(client, COMPLETIONS, completion_body(stream_options=options))
    content = [c for c in chunks if c["choices"]]
    completion_tokens = [c["usage"]["completion_tokens"] for c in content]
    assert (
        completion_tokens == sorted(completion_tokens)
        and completion_tokens[-1] == chunks[-1]["usage"]["completion_tokens"]
    )
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in content)


async def test_one_created_per_response_even_across_seconds(
    client: httpx.AsyncClient, fake: FakeEngine, monkeypatch: Any
) -> None:
    """Every chunk (and every whole response) carries the `created` of its request, not the second it was built in."""
    import itertools
    import time

    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))  # each call is a second later
    for path, body in ((CHAT, chat_body(stream_options={"include_usage": True})), (COMPLETIONS, completion_body())):
        chunks = await stream(client, path, body)
        assert len(chunks) >= 3 and len({c["created"] for c in chunks}) == 1, [c["created"] for c in chunks]
        first, second = (await client.post(path, json=body)).json(), (await client.post(path, json=body)).json()
        assert first["created"] < second["created"]
