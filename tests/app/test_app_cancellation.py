"""A client that goes away aborts its engine requests (ASGITransport buffers, so disconnects are driven by hand)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import (
    CHAT,
    COMPLETIONS,
    MODEL,
    RawExchange,
    chat_body,
    completion_body,
    eventually,
    make_app,
    make_context,
    running,
    wait_until,
)
from transformers_openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from transformers_openai.serving.base import ClientDisconnected
from transformers_openai.serving.text.chat import ChatHandler
from transformers_openai.serving.text.completions import CompletionHandler


@pytest.fixture
def hanging() -> FakeEngine:
    return FakeEngine(Script(pieces=["Once", " upon"], hang=True))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat_body()),
        (COMPLETIONS, completion_body()),
        pytest.param(CHAT, chat_body(n=2)),
        pytest.param(COMPLETIONS, completion_body(prompt=["a", "b"])),
        pytest.param("/v1/responses", {"model": MODEL, "input": "Hi"}),
    ],
    ids=["chat", "completions", "chat-n2", "completions-2-prompts", "responses"],
)
async def test_stream_closed_after_first_chunk_aborts(
    hanging: FakeEngine, hf_tokenizer: Any, path: str, body: dict[str, Any]
) -> None:
    app = make_app(hanging, hf_tokenizer)
    async with running(app):
        exchange = RawExchange(app, path, {**body, "stream": True})
        task = asyncio.create_task(exchange.run())
        await asyncio.wait_for(exchange.got_event.wait(), 5)
        assert len(hanging.in_flight) == len(hanging.submitted) > 0
        exchange.disconnect.set()
        await asyncio.wait_for(task, 5)  # the response ends
        assert await eventually(lambda: not hanging.in_flight), f"still in flight: {hanging.in_flight}"
    assert sorted(hanging.aborted) == sorted(r.request_id for r in hanging.submitted)
    assert exchange.status == 200
    assert b"[DONE]" not in b"".join(exchange.chunks)


@pytest.mark.parametrize(
    ("path", "body", "rows"),
    [(CHAT, chat_body(n=2), 2), ("/v1/responses", {"model": MODEL, "input": "Hi"}, 1)],
    ids=["chat", "responses"],
)
async def test_non_streaming_disconnect_aborts_and_answers_499(
    hanging: FakeEngine, hf_tokenizer: Any, path: str, body: dict[str, Any], rows: int
) -> None:
    app = make_app(hanging, hf_tokenizer)
    async with running(app):
        exchange = RawExchange(app, path, body)
        task = asyncio.create_task(exchange.run())
        await wait_until(lambda: len(hanging.in_flight) == rows)
        exchange.disconnect.set()
        await asyncio.wait_for(task, 5)
    assert exchange.status == 499
    assert sorted(hanging.aborted) == sorted(r.request_id for r in hanging.submitted)


async def _soon() -> None:
    await asyncio.sleep(0.05)


async def test_chat_handler_disconnect_raises_and_aborts(hanging: FakeEngine, hf_tokenizer: Any) -> None:
    await hanging.start()
    handler = ChatHandler(make_context(hanging, hf_tokenizer))
    request = ChatCompletionRequest(model=MODEL, messages=[ChatMessage(role="user", content="Hi")])
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(handler.create(request, _soon), 5)
    [submitted] = hanging.submitted
    assert hanging.aborted == [submitted.request_id]
    assert not hanging.in_flight
    await hanging.stop()


async def test_completion_handler_disconnect_aborts_every_choice(hanging: FakeEngine, hf_tokenizer: Any) -> None:
    await hanging.start()
    handler = CompletionHandler(make_context(hanging, hf_tokenizer))
    request = CompletionRequest(model=MODEL, prompt=["a", "b"], n=2)
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(handler.create(request, _soon), 5)
    assert len(hanging.submitted) == 4
    assert sorted(hanging.aborted) == sorted(r.request_id for r in hanging.submitted)
    await hanging.stop()


async def test_finished_request_is_not_reported_as_aborted(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(make_app(fake, hf_tokenizer)) as client:
        assert (await client.post(CHAT, json=chat_body(n=2))).status_code == 200
        assert (await client.post(CHAT, json=chat_body(stream=True))).status_code == 200
    assert fake.aborted == []  # abort() may be called after the finish, but there is nothing left to free
    assert not fake.in_flight
