"""The Host header check against DNS rebinding: a server bound to loopback answers loopback names only (by
default), one bound to every address answers any, `--allowed-hosts` names them, and a refusal is a 400 in OpenAI's
shape before auth or anything else runs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.types import Message

from tests.app.fake_engine import FakeEngine
from tests.app.support import assert_error, make_app, running, wait_until_async
from transformers_openai.api.middleware import allowed_hosts

LOOPBACK_FORMS = ["localhost", "LOCALHOST:8000", "localhost.", "127.0.0.1", "127.0.0.1:8000", "127.0.0.9", "[::1]"]
LOOPBACK_FORMS += ["[::1]:8000"]
FOREIGN = ["attacker.example", "attacker.example:8000", "localhost.attacker.example", "10.0.0.1", "[::2]:80", ""]


async def status_for(client: httpx.AsyncClient, host: str, **headers: str) -> httpx.Response:
    return await client.get("/v1/models", headers={"host": host, **headers})


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
async def test_a_loopback_server_answers_loopback_names_only(fake: FakeEngine, hf_tokenizer: Any, bind: str) -> None:
    async with running(make_app(fake, hf_tokenizer, host=bind)) as client:
        for host in LOOPBACK_FORMS:
            assert (await status_for(client, host)).status_code == 200, host
        for host in FOREIGN:
            refused = await status_for(client, host)
            assert_error(refused, 400, code="invalid_host")


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.1.2.3"])
async def test_a_server_on_other_addresses_answers_any_name(fake: FakeEngine, hf_tokenizer: Any, bind: str) -> None:
    async with running(make_app(fake, hf_tokenizer, host=bind)) as client:
        for host in [*LOOPBACK_FORMS, *FOREIGN]:
            assert (await status_for(client, host)).status_code == 200, host


async def test_named_hosts_replace_the_default(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, allowed_hosts="api.example.com,*.internal.example,::1")
    async with running(app, wait_ready=False) as client:
        await wait_until_async(lambda: ready(client, "api.example.com"))
        for host in ["api.example.com", "API.example.com:443", "a.internal.example", "b.a.internal.example:80"]:
            assert (await status_for(client, host)).status_code == 200, host
        assert (await status_for(client, "[::1]:8000")).status_code == 200
        for host in ["localhost", "127.0.0.1", "internal.example", "api.example.com.evil", "xinternal.example"]:
            assert_error(await status_for(client, host), 400, code="invalid_host")


async def ready(client: httpx.AsyncClient, host: str) -> bool:
    return (await client.get("/health", headers={"host": host})).status_code == 200


async def test_a_star_answers_any_name_on_loopback(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(make_app(fake, hf_tokenizer, host="127.0.0.1", allowed_hosts=["*"])) as client:
        assert (await status_for(client, "attacker.example:8000")).status_code == 200


async def test_the_host_check_runs_before_auth_and_the_body(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(make_app(fake, hf_tokenizer, api_keys=["k"])) as client:
        refused = await client.post(
            "/v1/chat/completions", headers={"host": "attacker.example", "authorization": "Bearer k"}, content=b"\xff"
        )
        assert_error(refused, 400, code="invalid_host")
        assert_error(await status_for(client, "attacker.example"), 400, code="invalid_host")
        assert (await status_for(client, "localhost", authorization="Bearer k")).status_code == 200
    assert not fake.submitted


async def test_a_request_without_a_host_header_passes(fake: FakeEngine, hf_tokenizer: Any) -> None:
    """HTTP/1.0 health checks (HAProxy's `option httpchk`) send none; a browser always does."""
    app = make_app(fake, hf_tokenizer)
    async with running(app):
        sent: list[Message] = []

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.0", "method": "GET", "scheme": "http",
            "path": "/health", "raw_path": b"/health", "query_string": b"", "root_path": "", "headers": [],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        }  # fmt: skip
        await app(scope, receive, send)
        assert sent[0]["status"] == 200


def test_the_default_follows_the_bound_address() -> None:
    assert allowed_hosts([], "127.0.0.1") == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts([], "::1") == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts([], "0.0.0.0") == ["*"]
    assert allowed_hosts([], "example.com") == ["*"]
    assert allowed_hosts(["a.example"], "127.0.0.1") == ["a.example"]
