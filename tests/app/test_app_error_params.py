"""Error details: the param named for union fields and unsupported fields, empty and oversized bodies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, assert_error, chat_body, completion_body, make_app, running


@pytest.mark.parametrize(
    ("path", "body", "param"), [(CHAT, chat_body(stop=5), "stop"), (COMPLETIONS, completion_body(prompt=5), "prompt")]
)
async def test_type_error_in_a_union_field_names_the_field(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(await client.post(path, json=body), 400, param=param)


async def test_empty_body_gets_a_readable_message(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.post(CHAT, content=b"", headers={"content-type": "application/json"}), 400)
    assert "None" not in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (CHAT, chat_body(response_format={"type": "json_schema"}), "response_format"),
        (COMPLETIONS, completion_body(suffix="The end."), "suffix"),
        (COMPLETIONS, completion_body(best_of=3, n=1), "best_of"),
    ],
)
async def test_unsupported_field_is_the_error_param(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(await client.post(path, json=body), 400, param=param)


async def test_chunked_body_over_the_limit_is_413(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit is found while reading
        for _ in range(4):
            yield b" " * 600

    async with running(make_app(fake, hf_tokenizer, max_request_bytes=1024)) as client:
        response = await client.post(CHAT, content=chunked(), headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers
        assert_error(response, 413, code="request_too_large")
