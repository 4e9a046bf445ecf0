"""The one SSE helper: pydantic chunks as `data:` events, an error event on failure, then `data: [DONE]`; or, for a
stream of named events (/v1/responses), each as `event: <type>` with its data, and no `[DONE]`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError
from starlette.types import Receive, Scope, Send

from transformers_openai.serving.errors import OpenAIError, ServiceUnavailableError, to_openai_error

logger = logging.getLogger(__name__)

# Keep-alive comments let proxies hold long, quiet streams open; the OpenAI client ignores them.
PING_INTERVAL_S = 15


@runtime_checkable
class NamedEventStream(Protocol):
    """A stream whose events name themselves (their `type`) and report a failure as an event of their own."""

    def error_event(self, error: OpenAIError) -> BaseModel: ...


@dataclass(frozen=True)
class StreamEnds:
    """Who is told how a stream ended early, once each (the metrics)."""

    on_stall: Callable[[], None]
    on_disconnect: Callable[[], None]


class _EventStream(EventSourceResponse):
    """An SSE response whose client must take each event within `stall_timeout_s` seconds.

    A client that stops reading has its row paused by the engine's flow control soon; when one send (an event
    or a ping) blocks this long, sse-starlette closes the event generator, which aborts the engine request, and
    raises SendTimeoutError out of the response: here it becomes one warning and `on_stall()`, not an
    application error. A stream cut short otherwise was a disconnect: one warning and `on_disconnect()`.
    """

    def __init__(
        self, chunks: AsyncIterator[BaseModel], request_id: str, stall_timeout_s: float, ends: StreamEnds
    ) -> None:
        super().__init__(self._events(chunks), ping=PING_INTERVAL_S, sep="\n", send_timeout=stall_timeout_s)
        self._request_id = request_id
        self._stall_timeout_s = stall_timeout_s
        self._ends = ends
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # The connection cannot be ended cleanly (the blocked send is never drained): the server closes it.
            logger.warning(
                "request %s: stream stalled, the client took no data for %gs; aborted",
                self._request_id,
                self._stall_timeout_s,
            )
            self._ends.on_stall()
            return
        if not self._complete:
            logger.warning("request %s: client disconnected mid-stream; aborted", self._request_id)
            self._ends.on_disconnect()

    async def _events(self, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[ServerSentEvent]:
        named = chunks if isinstance(chunks, NamedEventStream) else None
        try:
            async for chunk in chunks:
                event = getattr(chunk, "type", None) if named else None
                yield ServerSentEvent(data=chunk.model_dump_json(), event=event)
        except Exception as exc:  # the status line is sent already: report in-band
            error = to_openai_error(exc)
            if error.status_code >= 500 and not isinstance(error, ServiceUnavailableError):
                logger.exception("stream failed")  # a shutdown is not a failure: the server logs it once
            if named is not None:
                yield ServerSentEvent(data=named.error_event(error).model_dump_json(), event="error")
            else:
                yield ServerSentEvent(data=error.body().model_dump_json())
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        self._complete = True
        if named is None:
            yield ServerSentEvent(data="[DONE]")


def sse_response(
    chunks: AsyncIterator[BaseModel], request_id: str, stall_timeout_s: float, ends: StreamEnds
) -> EventSourceResponse:
    """Streams `chunks`; `request_id` names the request in the log lines of a stall or a disconnect."""
    return _EventStream(chunks, request_id, stall_timeout_s, ends)
