"""Every rejected request gets OpenAI's error shape and the right 4xx, and leaves the server serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, assert_error, chat_body, completion_body, make_app, running

USER = [{"role": "user", "content": "Hi"}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
AUDIO_PART = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]

# (path, body, status, param, code); param/code None means "not checked"
CASES: list[tuple[str, dict[str, Any], int, str | None, str | None]] = [
    (CHAT, chat_body(temperature=3), 400, "temperature", None),
    (CHAT, chat_body(temperature="hot"), 400, "temperature", None),
    (CHAT, chat_body(n="three"), 400, "n", None),
    (CHAT, chat_body(stream="maybe"), 400, "stream", None),
    (CHAT, chat_body(messages="hi"), 400, "messages", None),
    (CHAT, chat_body(top_p=0), 400, "top_p", None),
    (CHAT, chat_body(max_tokens=0), 400, "max_tokens", None),
    (CHAT, chat_body(n=0), 400, "n", None),
    (CHAT, chat_body(n=100), 400, "n", None),
    (CHAT, chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    (CHAT, chat_body(messages=[]), 400, "messages", None),
    (CHAT, chat_body(messages=[{"role": "function", "content": "x"}]), 400, "messages.0.role", None),
    (CHAT, chat_body(messages=[{"role": "foo", "content": "x"}]), 400, "messages.0.role", None),
    (CHAT, chat_body(messages=IMAGE), 400, "messages", None),  # a text-only model reads no images
    (CHAT, chat_body(messages=AUDIO_PART), 400, "messages.0.content", None),
    (CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", None),  # no template
    (CHAT, chat_body(response_format={"type": "xml"}), 400, "response_format.type", None),
    (CHAT, chat_body(response_format={"type": "json_object"}), 400, "response_format", None),  # no grammar support
    (CHAT, chat_body(model="gpt-4o"), 404, "model", "model_not_found"),
    (CHAT, chat_body(frobnicate=1), 400, "frobnicate", "unknown_parameter"),
    (CHAT, {"messages": USER}, 400, "model", "missing_required_parameter"),
    (COMPLETIONS, completion_body(suffix="The end."), 400, None, None),
    (COMPLETIONS, completion_body(best_of=3, n=1), 400, None, None),
    (COMPLETIONS, completion_body(model="gpt-4o"), 404, "model", "model_not_found"),
    (COMPLETIONS, completion_body(frobnicate=1), 400, "frobnicate", "unknown_parameter"),
    (
        COMPLETIONS,
        completion_body(prompt=list(range(1, 250)), max_tokens=10),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (COMPLETIONS, completion_body(prompt=list(range(1, 300))), 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, completion_body(logit_bias={"999999": 5}), 400, "logit_bias", None),
    (COMPLETIONS, completion_body(logit_bias={"abc": 5}), 400, "logit_bias", None),
    (COMPLETIONS, completion_body(prompt=[49152]), 400, "prompt", None),
    (COMPLETIONS, completion_body(prompt=[[]]), 400, "prompt", None),
    (COMPLETIONS, completion_body(prompt=[]), 400, None, None),
]


def case_id(case: tuple[str, dict[str, Any], int, str | None, str | None]) -> str:
    path, body, *_ = case
    extra = {k: v for k, v in body.items() if k not in ("messages", "prompt") or v not in (USER, "Once upon a time")}
    return f"{path.rsplit('/', 1)[-1]}-{str(extra)[:60]}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
async def test_rejected(
    client: httpx.AsyncClient, fake: FakeEngine, case: tuple[str, dict[str, Any], int, str | None, str | None]
) -> None:
    path, body, status, param, code = case
    assert_error(await client.post(path, json=body), status, param=param, code=code)
    assert not fake.submitted


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (chat_body(functions=[{"name": "f"}]), "functions"),
        (chat_body(function_call="auto"), "function_call"),
    ],
)
async def test_unsupported_fields_are_named(client: httpx.AsyncClient, body: dict[str, Any], named: str) -> None:
    error = assert_error(await client.post(CHAT, json=body), 400)
    assert f"'{named}'" in error["message"]


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(response, 400, code="invalid_json")


async def test_engine_overloaded_is_429_with_retry_after(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.capacity = 2
    for path, body in ((CHAT, chat_body(n=3)), (COMPLETIONS, completion_body(prompt=["a", "b", "c"], stream=True))):
        response = await client.post(path, json=body)
        error = assert_error(response, 429)
        assert error["type"] == "rate_limit_error"
        assert response.headers["retry-after"] == "3"
    assert not fake.submitted
    assert (await client.post(CHAT, json=chat_body(n=2))).status_code == 200


async def test_body_over_the_limit_is_413(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(make_app(fake, hf_tokenizer, max_request_bytes=1024)) as client:
        big = chat_body(messages=[{"role": "user", "content": "x" * 2000}])
        assert_error(await client.post(CHAT, json=big), 413, code="request_too_large")
        assert (await client.post(CHAT, json=chat_body())).status_code == 200
    assert len(fake.submitted) == 1


async def test_server_is_unharmed_by_every_rejection(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    for path, body, status, *_ in CASES:
        assert (await client.post(path, json=body)).status_code == status
    assert (await client.post(CHAT, content=b"{", headers={"content-type": "application/json"})).status_code == 400
    fake.capacity = 0
    assert (await client.post(CHAT, json=chat_body())).status_code == 429
    fake.capacity = 64
    assert not fake.submitted
    ok = await client.post(CHAT, json=chat_body())
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["message"]["content"] == "Hello, world"
    assert (await client.post(COMPLETIONS, json=completion_body(stream=True))).status_code == 200
    assert (await client.get("/health")).status_code == 200
    assert not fake.in_flight
