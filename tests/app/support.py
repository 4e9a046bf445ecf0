"""Helpers for the in-process app tests: build the app on a FakeEngine, run its lifespan, read SSE and errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.types import Message

from tests.app.fake_engine import FakeEngine
from transformers_openai.api.app import create_app
from transformers_openai.api.state import Loader
from transformers_openai.serving.context import Capability, ServingContext, VisionPrompts
from transformers_openai.serving.tokenizer import TokenizerService
from transformers_openai.settings import Settings

MODEL = "fake-model"
MAX_MODEL_LEN = 256
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}
# The app's Settings bind 127.0.0.1 by default, so the Host check accepts loopback names only.
BASE_URL = "http://localhost"


def make_context(engine: FakeEngine, hf_tokenizer: Any, vision: VisionPrompts | None = None) -> ServingContext:
    """A text model's context; with `vision`, a vision-language model's (it reads images through `vision`)."""
    return ServingContext(
        engine=engine,
        tokenizer=TokenizerService(hf_tokenizer),
        model_name=MODEL,
        model_aliases=frozenset({MODEL}),
        max_model_len=MAX_MODEL_LEN,
        model_kind="causal-lm",
        capabilities=frozenset({Capability.TEXT, Capability.VISION} if vision else {Capability.TEXT}),
        vision=vision,
    )


def make_app(engine: FakeEngine, hf_tokenizer: Any, loader: Loader | None = None, **settings: Any) -> FastAPI:
    return create_app(Settings(model=MODEL, **settings), loader=loader or (lambda: make_context(engine, hf_tokenizer)))


LOAD_TIMEOUT_S = 60.0


@asynccontextmanager
async def running(app: FastAPI, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """Runs the app's lifespan around an in-process client; by default waits until /health says ready."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=10) as client:
            if wait_ready:  # loading runs in a worker thread: on a busy 2-core machine it may wait its turn a while
                await wait_until_async(lambda: _healthy(client), timeout=LOAD_TIMEOUT_S)
            yield client


async def _healthy(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health")).status_code == 200


async def wait_until_async(check: Callable[[], Any], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.01)


async def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def eventually(check: Callable[[], bool], timeout: float = 1.0) -> bool:
    """Whether `check` comes true within `timeout` (for asserting on things other tasks do)."""
    try:
        await wait_until(check, timeout)
    except TimeoutError:
        return False
    return True


def sse_data(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments and blank lines dropped)."""
    return [line[len("data:") :].strip() for line in body.splitlines() if line.startswith("data:")]


def sse_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON events of a stream that must end with `data: [DONE]`."""
    data = sse_data(body)
    assert data and data[-1] == "[DONE]", data[-3:]
    assert "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Checks OpenAI's error shape and status; `param`/`code` are checked when given."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    if status < 429:
        assert error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


class RawExchange:
    """One request driven straight through the ASGI app, so that the test decides when the client goes away."""

    def __init__(self, app: FastAPI, path: str, body: dict[str, Any], request_id: str | None = None) -> None:
        self.app = app
        self.body = json.dumps(body).encode()
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"localhost"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()),
                *([(b"x-request-id", request_id.encode())] if request_id else []),
            ],
            "client": ("127.0.0.1", 12345),
            "server": ("localhost", 80),
        }
        self.status: int | None = None
        self.chunks: list[bytes] = []
        self.got_event = asyncio.Event()
        self.disconnect = asyncio.Event()
        self.reading = True  # set False: every later send blocks, as when a client stops reading its socket
        self._body_sent = False

    async def run(self) -> None:
        await self.app(self.scope, self._receive, self._send)

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if not self.reading:
            await asyncio.Event().wait()  # until the server gives up on this send
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            self.chunks.append(message["body"])
            if b"data:" in message["body"]:
                self.got_event.set()
