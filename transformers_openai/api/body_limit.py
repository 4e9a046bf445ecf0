"""Request bodies before the app parses them: over the size limit 413, text that is not UTF-8 400, and past the
global budget of bytes in flight 503. JSON bodies are read whole, then replayed; multipart forms (audio uploads)
stream through to the form parser, which spools their files to disk."""

from __future__ import annotations

from starlette.formparsers import MultiPartParser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from transformers_openai.api.errors import error_response
from transformers_openai.api.heap import HeapTrimmer
from transformers_openai.api.inflight import ByteBudget
from transformers_openai.serving.errors import (
    BadRequestError,
    OpenAIError,
    PayloadTooLargeError,
    ServiceUnavailableError,
)

RETRY_AFTER_S = 1


class BodySizeLimit:
    """Counts every body against its limit (by Content-Length when declared, by counting when chunked) and against
    the budget: declared bytes are reserved before any arrive, chunked ones as they arrive.

    A JSON body is held until its request ends (the app keeps it that long). A form's bytes are given back once the
    parser has taken them, except the first MiB, which its spooled file keeps in memory. Multipart forms have their
    own, larger limit, `max_form_bytes`. After a body of at least `trim_after_bytes`, the heap memory it freed is
    given back to the system.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        budget: ByteBudget,
        max_form_bytes: int | None = None,
        trim_after_bytes: int = 1024 * 1024,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = budget
        self.max_form_bytes = max_form_bytes or max_bytes
        self.trim_after_bytes = trim_after_bytes
        self._trim = HeapTrimmer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        form = _is_form(scope)
        # A body larger than the whole budget could never be held: that is a 413, not a 503 to retry.
        limit = min(self.max_form_bytes if form else self.max_bytes, self.budget.limit)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reject(scope, receive, send, _too_large(limit))
            return
        intake = _Intake(self.budget, limit, declared or 0)
        try:
            if not intake.hold.take(declared or 0):
                await _reject(scope, receive, send, _overloaded(self.budget.limit))
            elif form:
                await self._stream(scope, receive, send, intake)
            else:
                await self._buffer(scope, receive, send, intake)
        finally:
            intake.hold.close()
            if intake.received >= self.trim_after_bytes:
                self._trim()

    async def _buffer(self, scope: Scope, receive: Receive, send: Send, intake: _Intake) -> None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay(message, receive), send)
                return
            body = message.get("body", b"")
            error = intake.arrive(len(body))
            if error is not None:
                await _reject(scope, receive, send, error)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        if body and not _is_utf8(body):
            # json.loads would guess UTF-16 or UTF-32; OpenAI takes UTF-8 JSON only.
            error = BadRequestError("the request body is not UTF-8 encoded JSON", code="invalid_encoding")
            await _reject(scope, receive, send, error)
            return
        whole: Message = {"type": "http.request", "body": body, "more_body": False}
        del body
        await self.app(scope, _replay(whole, receive), send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send, intake: _Intake) -> None:
        """Passes the form's chunks to the app as they come. A chunk past a limit ends the parse with an error
        from `receive`; the app's own answer to that is dropped and ours is sent instead."""
        refused: OpenAIError | None = None
        started = False
        passed = 0  # the size of the chunk the app was last given

        async def counted_receive() -> Message:
            nonlocal passed, refused
            intake.parsed(passed)  # asking for more: the parser has written the last chunk to its file
            passed = 0
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                refused = intake.arrive(size)
                if refused is not None:
                    raise BodyRefused(refused)
                passed = size
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused is not None:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if refused is None or started:
                raise
        if refused is not None and not started:
            await _reject(scope, receive, send, refused)


class BodyRefused(Exception):
    """Raised from `receive` when a streamed body passes a limit: the parse ends, the middleware answers."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


class _Intake:
    """One request's body as it arrives, counted against its size limit and its hold on the budget."""

    def __init__(self, budget: ByteBudget, limit: int, declared: int) -> None:
        self.hold = budget.hold()
        self.limit = limit
        self.received = 0
        self._budget_limit = budget.limit
        self._ahead = declared  # reserved by Content-Length, not arrived yet
        self._kept = 0

    def arrive(self, size: int) -> OpenAIError | None:
        """Counts a chunk: the error to answer when it passes the size limit (413) or the budget (503)."""
        self.received += size
        if self.received > self.limit:
            return _too_large(self.limit)
        covered = min(size, self._ahead)
        self._ahead -= covered
        return None if self.hold.take(size - covered) else _overloaded(self._budget_limit)

    def parsed(self, size: int) -> None:
        """A form chunk the parser has taken: given back, but for the first bytes its spooled file keeps."""
        keep = min(size, max(0, MultiPartParser.spool_max_size - self._kept))
        self._kept += keep
        self.hold.release(size - keep)


async def _reject(scope: Scope, receive: Receive, send: Send, error: OpenAIError) -> None:
    response = error_response(error, scope["path"])
    if error.status_code == 503:
        response.headers["retry-after"] = str(RETRY_AFTER_S)
    await response(scope, receive, send)


def _overloaded(limit: int) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"the server holds as many request body bytes as it may at once ({limit}); retry later",
        code="server_overloaded",
    )


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body is larger than the limit of {limit} bytes")


def _content_length(scope: Scope) -> int | None:
    declared = dict(scope.get("headers", ())).get(b"content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


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
