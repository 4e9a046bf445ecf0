"""Cheap prompt limits answer before validation and templating: too many messages or parts, more characters than
the context could ever hold, more prompts than the server holds; each a 400 naming the limit and its setting."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import (
    CHAT,
    COMPLETIONS,
    MAX_MODEL_LEN,
    assert_error,
    chat_body,
    completion_body,
    make_app,
    make_context,
    running,
)
from transformers_openai.serving.prompt_limits import PromptLimits

LIMITS = PromptLimits(
    max_messages=8, max_content_parts=10, max_prompt_tokens=MAX_MODEL_LEN, max_token_chars=4, max_sequences=6
)


@pytest.fixture
async def limited(fake: FakeEngine, hf_tokenizer: Any) -> Any:
    context = replace(make_context(fake, hf_tokenizer), prompt_limits=LIMITS)
    async with running(make_app(fake, hf_tokenizer, loader=lambda: context)) as client:
        yield client


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


async def test_too_many_messages_is_refused_before_validation(limited: httpx.AsyncClient, fake: FakeEngine) -> None:
    # Invalid messages beyond the limit: the count answers first, so none of them is ever validated.
    body = chat_body(messages=[{"role": "nobody"}] * 9)
    error = assert_error(await limited.post(CHAT, json=body), 400, "messages", "too_many_messages")
    assert "--max-chat-messages" in error["message"] and "8" in error["message"]
    assert fake.submitted == []
    assert (await limited.post(CHAT, json=chat_body(messages=[user("hi")] * 8))).status_code == 200


async def test_too_many_content_parts(limited: httpx.AsyncClient) -> None:
    parts = [{"type": "text", "text": "a"}] * 6
    error = assert_error(await limited.post(CHAT, json=chat_body(messages=[user(parts), user(parts)])), 400, "messages")
    assert error["code"] == "too_many_content_parts" and "--max-content-parts" in error["message"]
    assert (await limited.post(CHAT, json=chat_body(messages=[user(parts[:5]), user(parts[:5])]))).status_code == 200


async def test_more_characters_than_the_context_can_hold(limited: httpx.AsyncClient) -> None:
    most = MAX_MODEL_LEN * 4  # no tokenization of more characters can fit
    body = chat_body(messages=[user("x" * (most // 2)), user([{"type": "text", "text": "y" * (most // 2 + 1)}])])
    error = assert_error(await limited.post(CHAT, json=body), 400, "messages", "context_length_exceeded")
    assert f"{MAX_MODEL_LEN} tokens" in error["message"]
    error = assert_error(await limited.post(COMPLETIONS, json=completion_body(prompt="z" * (most + 1))), 400, "prompt")
    assert error["code"] == "context_length_exceeded"


async def test_completions_prompts_beyond_what_the_server_holds(limited: httpx.AsyncClient) -> None:
    error = assert_error(await limited.post(COMPLETIONS, json=completion_body(prompt=["a"] * 4, n=2)), 400, "n")
    assert error["code"] == "too_many_sequences" and "--max-batch-size" in error["message"]
    ids = list(range(1, MAX_MODEL_LEN + 2))
    assert_error(await limited.post(COMPLETIONS, json=completion_body(prompt=ids)), 400, "prompt")
    assert_error(await limited.post(COMPLETIONS, json=completion_body(prompt=[[1, 2], ids])), 400, "prompt")


async def test_malformed_bodies_are_left_to_validation(limited: httpx.AsyncClient) -> None:
    for body in ({"model": "fake-model", "messages": "not a list"}, [1, 2, 3]):
        assert_error(await limited.post(CHAT, json=body), 400)
    assert_error(await limited.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 400)
