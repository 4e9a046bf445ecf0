"""Wire compatibility: the official `openai` client parses every answer, stream and error of the app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import BASE_URL, MODEL, make_app, running

MESSAGES: list[Any] = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
async def oai(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[AsyncOpenAI]:
    app = make_app(fake, hf_tokenizer)
    async with running(app):
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        # The SDK takes httpx's own client as well as httpx2's, though its annotation names httpx2's only.
        client = AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="x", http_client=http_client, max_retries=0)  # type: ignore[arg-type]
        async with client as oai:
            yield oai


async def test_chat(oai: AsyncOpenAI, fake: FakeEngine) -> None:
    completion = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=1, max_tokens=10)
    assert completion.object == "chat.completion"
    assert [c.message.content for c in completion.choices] == ["Hello, world"] * 2
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[1].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(fake.submitted[0].prompt_token_ids)
    assert completion.usage.completion_tokens == 6


async def test_chat_stream(oai: AsyncOpenAI, fake: FakeEngine) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_chat_logprobs(oai: AsyncOpenAI) -> None:
    completion = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [len(t.top_logprobs) for t in logprobs.content] == [3, 3, 3]


async def test_completions(oai: AsyncOpenAI) -> None:
    completion = await oai.completions.create(model=MODEL, prompt=["One", "Two"], n=2, echo=True)
    assert completion.object == "text_completion"
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices][1:3] == ["OneHello, world", "TwoHello, world"]
    assert completion.usage is not None and completion.usage.completion_tokens == 12


async def test_completions_stream(oai: AsyncOpenAI) -> None:
    stream = await oai.completions.create(
        model=MODEL, prompt="Once", stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, world"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 3


async def test_models(oai: AsyncOpenAI) -> None:
    assert [m.id async for m in oai.models.list()] == [MODEL]
    assert (await oai.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


async def test_errors_are_typed(oai: AsyncOpenAI, fake: FakeEngine) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3)
    assert caught.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="gpt-4o", prompt="x")
    fake.capacity = 0
    with pytest.raises(openai.RateLimitError) as overloaded:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert overloaded.value.response.headers["retry-after"] == "3"


async def test_error_mid_stream_raises(oai: AsyncOpenAI, fake: FakeEngine) -> None:
    fake.script = Script(error_after=2)
    stream = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    seen: list[str] = []
    with pytest.raises(openai.APIError, match="boom"):
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "Hello,"
