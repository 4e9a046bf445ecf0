"""ASGI middleware: X-Request-Id, API-key authentication, and CORS answering in our error shape."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from transformers_openai.api.errors import error_response
from transformers_openai.logs import request_id_var
from transformers_openai.serving.errors import AuthenticationError, BadRequestError

REQUEST_ID_HEADER = "x-request-id"
_MAX_ID_LENGTH = 128


class RequestIdMiddleware:
    """Takes the client's X-Request-Id (or makes one), exposes it to logs and handlers, and echoes it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1").strip()
        request_id = given[:_MAX_ID_LENGTH] if given and given.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


class ApiKeyAuth:
    """Requires `Authorization: Bearer <key>` with one of the configured keys, compared in constant time."""

    def __init__(self, app: ASGIApp, keys: list[str], open_paths: Callable[[str], bool]) -> None:
        self.app = app
        self._keys = [key.encode() for key in keys]
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or self._open(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # Compare against every key so the time taken does not tell which key was close.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(token.strip(), key)
        if scheme.lower() != b"bearer" or not matched:
            error = AuthenticationError("invalid or missing API key; send 'Authorization: Bearer <key>'")
            response = error_response(error)
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORS handling, with a refused preflight answered in our error shape (it says plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = error_response(BadRequestError(bytes(response.body).decode(), code="cors_rejected"))
        for name in ("vary", "access-control-allow-methods", "access-control-max-age"):
            if name in response.headers:
                refused.headers[name] = response.headers[name]
        return refused
