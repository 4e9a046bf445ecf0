"""Rejects request bodies over the configured size with 413, before they are read whole."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from transformers_openai.serving.errors import PayloadTooLargeError


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise PayloadTooLargeError(self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        from transformers_openai.api.errors import error_response

        await error_response(PayloadTooLargeError(self._message()))(scope, receive, send)
