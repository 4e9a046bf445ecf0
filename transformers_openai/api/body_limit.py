"""Reads request bodies before the app parses them: over the size limit 413, text that is not UTF-8 400."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from transformers_openai.api.errors import error_response
from transformers_openai.api.heap import HeapTrimmer
from transformers_openai.serving.errors import BadRequestError, OpenAIError, PayloadTooLargeError


class BodySizeLimit:
    """Reads the body up to the limit (by Content-Length when declared, by counting when chunked), then replays it.

    Multipart forms (audio uploads) have their own, larger limit, `max_form_bytes`. After a body of at least
    `trim_after_bytes` is answered, the heap memory it freed is given back to the system.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, max_form_bytes: int | None = None, trim_after_bytes: int = 1024 * 1024
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_form_bytes = max_form_bytes or max_bytes
        self.trim_after_bytes = trim_after_bytes
        self._trim = HeapTrimmer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_form_bytes if _is_form(scope) else self.max_bytes
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit=limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay(message, receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._reject(scope, receive, send, limit=limit)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and not _is_form(scope) and not _is_utf8(body):
            # json.loads would guess UTF-16 or UTF-32; OpenAI takes UTF-8 JSON only.
            error = BadRequestError("the request body is not UTF-8 encoded JSON", code="invalid_encoding")
            await self._reject(scope, receive, send, error)
            return
        large = size >= self.trim_after_bytes
        whole: Message = {"type": "http.request", "body": body, "more_body": False}
        del body, chunks
        await self.app(scope, _replay(whole, receive), send)
        if large:
            del whole
            self._trim()

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, error: OpenAIError | None = None, limit: int = 0
    ) -> None:
        error = error or PayloadTooLargeError(f"request body is larger than the limit of {limit} bytes")
        await error_response(error)(scope, receive, send)


def _is_form(scope: Scope) -> bool:
    """multipart/form-data carries binary files (audio): its parts are checked by whoever reads them."""
    content_type = dict(scope.get("headers", ())).get(b"content-type", b"")
    return bool(content_type.lower().startswith(b"multipart/"))


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that hands out `first` once, then waits on the real one (for the disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return first
        return await receive()

    return replay
