"""The budget of request body bytes in flight: bodies past it get a 503 in OpenAI's shape with Retry-After, the
bytes held never pass it, and every request gives back what it held on whatever path it ends (answered, refused,
client gone, app failed). Multipart uploads stream through to the form parser instead of being joined in memory."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, File, UploadFile
from starlette.types import Message, Scope

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, ERROR_KEYS, chat_body, make_app, running, wait_until
from transformers_openai.api.body_limit import BodySizeLimit
from transformers_openai.api.inflight import ByteBudget

KIB = 1024
MIB = 1024 * KIB
BUDGET = MIB  # the smallest --max-inflight-bytes
BOUNDARY = "testboundary7MA4YWxkTrZu0gW"


class Exchange:
    """One request driven through the ASGI app by hand: the test decides when each chunk of its body arrives."""

    def __init__(self, app: Any, path: str, content_type: str, length: int | None = None) -> None:
        headers = [(b"host", b"localhost"), (b"content-type", content_type.encode())]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        self.scope: Scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 12345), "server": ("localhost", 80),
        }  # fmt: skip
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self.task = asyncio.create_task(app(self.scope, self.inbox.get, self._send))

    def send(self, data: bytes, more: bool = True) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": data, "more_body": more})

    def leave(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    async def done(self) -> Exchange:
        await asyncio.wait_for(self.task, 10)
        return self

    def error(self) -> dict[str, Any]:
        body = json.loads(self.body)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
        return dict(body["error"])

    async def _send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


def padded_chat(size: int) -> bytes:
    """A valid chat request of exactly `size` bytes (JSON allows trailing white space)."""
    body = json.dumps(chat_body(max_tokens=2)).encode()
    return body + b" " * (size - len(body))


def chunks_of(data: bytes, size: int) -> Iterator[bytes]:
    return (data[i : i + size] for i in range(0, len(data), size))


def assert_overloaded(exchange: Exchange) -> None:
    assert exchange.status == 503, exchange.body
    assert exchange.headers.get("retry-after") == "1"
    error = exchange.error()
    assert error["type"] == "service_unavailable" and error["code"] == "server_overloaded", error


async def test_declared_bodies_past_the_budget_get_503_and_all_bytes_come_back(
    fake: FakeEngine, hf_tokenizer: Any
) -> None:
    app = make_app(fake, hf_tokenizer, max_inflight_bytes=BUDGET)
    budget: ByteBudget = app.state.inflight_bytes
    size = 400 * KIB
    async with running(app):
        first, second = (Exchange(app, CHAT, "application/json", size) for _ in range(2))
        await wait_until(lambda: budget.held == 2 * size)  # reserved by Content-Length before any byte arrived
        third = await Exchange(app, CHAT, "application/json", size).done()
        assert_overloaded(third)
        for exchange in (first, second):
            for chunk in chunks_of(padded_chat(size), 64 * KIB):
                exchange.send(chunk)
            exchange.send(b"", more=False)
        for exchange in (first, second):
            await exchange.done()
            assert exchange.status == 200, exchange.body
        assert budget.held == 0
        assert budget.peak == 2 * size <= budget.limit
        # With the bytes back, the same request fits again.
        again = Exchange(app, CHAT, "application/json", size)
        again.send(padded_chat(size), more=False)
        assert (await again.done()).status == 200
        assert budget.held == 0


async def test_chunked_bodies_that_push_past_the_budget_get_503(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, max_inflight_bytes=BUDGET)
    budget: ByteBudget = app.state.inflight_bytes
    body = padded_chat(512 * KIB)
    async with running(app):
        first, second, third = (Exchange(app, CHAT, "application/json") for _ in range(3))
        for exchange in (first, second):
            exchange.send(body[: 384 * KIB])
        third.send(body[: 128 * KIB])
        await wait_until(lambda: budget.held == 896 * KIB)
        third.send(body[128 * KIB : 320 * KIB])  # 1088 KiB: past the budget
        await third.done()
        assert_overloaded(third)
        assert budget.held == 768 * KIB  # the refused body's bytes came back at once
        for exchange in (first, second):
            exchange.send(body[384 * KIB :], more=False)
            assert (await exchange.done()).status == 200, exchange.body
    assert budget.held == 0
    assert budget.peak == 896 * KIB <= budget.limit


async def test_a_body_larger_than_the_whole_budget_gets_413(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, max_inflight_bytes=BUDGET)  # max_request_bytes stays 10 MiB
    async with running(app):
        declared = await Exchange(app, CHAT, "application/json", BUDGET + 1).done()
        assert declared.status == 413 and declared.error()["code"] == "request_too_large"
        chunked = Exchange(app, CHAT, "application/json")
        for _ in range(17):
            chunked.send(b" " * (64 * KIB))
        await chunked.done()
        assert chunked.status == 413 and chunked.error()["code"] == "request_too_large"
    assert app.state.inflight_bytes.held == 0


async def test_a_client_that_leaves_mid_body_gives_its_bytes_back(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, max_inflight_bytes=BUDGET)
    budget: ByteBudget = app.state.inflight_bytes
    async with running(app):
        declared = Exchange(app, CHAT, "application/json", 600 * KIB)
        chunked = Exchange(app, CHAT, "application/json")
        declared.send(b"{" * (100 * KIB))
        chunked.send(b"{" * (100 * KIB))
        await wait_until(lambda: budget.held == 700 * KIB)
        declared.leave()
        chunked.leave()
        await declared.done()
        await chunked.done()
    assert budget.held == 0
    assert not fake.submitted


async def test_refused_bodies_give_their_bytes_back(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, max_inflight_bytes=BUDGET, max_request_bytes=256 * KIB)
    budget: ByteBudget = app.state.inflight_bytes
    async with running(app):
        too_large = Exchange(app, CHAT, "application/json")
        for _ in range(5):
            too_large.send(b" " * (64 * KIB))
        await too_large.done()
        assert too_large.status == 413 and too_large.error()["code"] == "request_too_large"
        not_utf8 = Exchange(app, CHAT, "application/json")
        not_utf8.send(json.dumps(chat_body()).encode("utf-16"), more=False)
        await not_utf8.done()
        assert not_utf8.status == 400 and not_utf8.error()["code"] == "invalid_encoding"
    assert budget.held == 0


async def test_an_app_that_fails_still_gives_the_bytes_back() -> None:
    budget = ByteBudget(BUDGET)

    async def failing(scope: Scope, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        raise RuntimeError("boom")

    for content_type in ("application/json", f"multipart/form-data; boundary={BOUNDARY}"):
        app = BodySizeLimit(failing, max_bytes=BUDGET, budget=budget)
        exchange = Exchange(app, "/x", content_type, 300 * KIB)
        exchange.send(b"{" * (300 * KIB), more=False)
        with pytest.raises(RuntimeError, match="boom"):
            await exchange.done()
        assert budget.held == 0


def form_parts(file_size: int, chunk: bytes) -> tuple[bytes, int, bytes]:
    """The head, the number of file chunks and the tail of a multipart upload of `file_size` bytes."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\nfake-model\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()
    assert file_size % len(chunk) == 0
    return head, file_size // len(chunk), tail


def upload_app(budget: ByteBudget, max_form_bytes: int) -> Any:
    """A route that takes an UploadFile as the audio routes do, and answers what arrived without reading it."""
    api = FastAPI()

    @api.post("/upload")
    async def upload(file: UploadFile = File(...)) -> dict[str, Any]:  # noqa: B008
        file.file.seek(0, 2)
        return {"size": file.file.tell(), "on_disk": bool(getattr(file.file, "_rolled", True))}

    return BodySizeLimit(api, max_bytes=MIB, budget=budget, max_form_bytes=max_form_bytes)


FORM = f"multipart/form-data; boundary={BOUNDARY}"


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_multipart_upload_is_spooled_not_joined_in_memory(declared: bool) -> None:
    file_size = 24 * MIB
    chunk = b"\x01" * (64 * KIB)  # one object sent again and again: the client side allocates nothing per chunk
    head, count, tail = form_parts(file_size, chunk)
    budget = ByteBudget(512 * MIB)
    app = upload_app(budget, max_form_bytes=32 * MIB)
    tracemalloc.start()
    try:
        exchange = Exchange(app, "/upload", FORM, len(head) + file_size + len(tail) if declared else None)
        exchange.send(head)
        for _ in range(count):
            exchange.send(chunk)
            await asyncio.sleep(0)  # let the parser keep up, as a socket's flow control would
        exchange.send(tail, more=False)
        await exchange.done()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exchange.status == 200, exchange.body
    assert json.loads(exchange.body) == {"size": file_size, "on_disk": True}
    # The old middleware joined the whole body (24 MiB and more); spooling keeps 1 MiB and a few chunks.
    assert peak < file_size / 8, f"peak {peak / MIB:.1f} MiB for a {file_size // MIB} MiB upload"
    assert budget.held == 0
    if not declared:  # only what is in memory counts: the first MiB its spooled file keeps, and a chunk
        assert budget.peak <= MIB + len(chunk)


async def test_uploads_past_the_budget_get_503_and_a_form_past_its_limit_413() -> None:
    budget = ByteBudget(BUDGET)
    app = upload_app(budget, max_form_bytes=2 * MIB)
    chunk = b"\x02" * (64 * KIB)
    head, count, tail = form_parts(384 * KIB, chunk)
    length = len(head) + 384 * KIB + len(tail)
    first, second = (Exchange(app, "/upload", FORM, length) for _ in range(2))
    await wait_until(lambda: budget.held == 2 * length)
    third = await Exchange(app, "/upload", FORM, length).done()
    assert_overloaded(third)
    for exchange in (first, second):
        exchange.send(head)
        for _ in range(count):
            exchange.send(chunk)
        exchange.send(tail, more=False)
        await exchange.done()
        assert exchange.status == 200 and json.loads(exchange.body)["size"] == 384 * KIB, exchange.body
    assert budget.held == 0
    assert budget.peak <= budget.limit

    # Without Content-Length: chunks past the budget, or past the form limit, end the parse with our answer.
    holder = Exchange(app, "/upload", FORM)
    holder.send(head + chunk * 12)  # 768 KiB held: the first MiB of a form stays counted while its file spools
    await wait_until(lambda: budget.held >= 768 * KIB)
    pushed = Exchange(app, "/upload", FORM)
    pushed.send(head)
    for _ in range(8):
        pushed.send(chunk)
    await pushed.done()
    assert_overloaded(pushed)
    holder.leave()
    await holder.done()
    assert budget.held == 0

    budget = ByteBudget(512 * MIB)
    app = upload_app(budget, max_form_bytes=2 * MIB)
    large = Exchange(app, "/upload", FORM)
    large.send(head)
    for _ in range(40):  # 2.5 MiB
        large.send(chunk)
    await large.done()
    assert large.status == 413 and large.error()["code"] == "request_too_large", large.body
    assert budget.held == 0
    assert budget.peak <= budget.limit


async def test_the_real_upload_route_refuses_past_the_budget(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, max_inflight_bytes=BUDGET)
    budget: ByteBudget = app.state.inflight_bytes
    async with running(app):
        holder = Exchange(app, "/v1/audio/transcriptions", FORM, 900 * KIB)
        await wait_until(lambda: budget.held == 900 * KIB)
        chunk = b"\x03" * (64 * KIB)
        head, _, _ = form_parts(64 * KIB, chunk)
        pushed = Exchange(app, "/v1/audio/transcriptions", FORM)
        pushed.send(head)
        for _ in range(3):
            pushed.send(chunk)
        await pushed.done()
        assert_overloaded(pushed)
        holder.leave()
        await holder.done()
    assert budget.held == 0
