"""uvicorn's HTTP/1.1 protocol with the guards it lacks: deadlines for headers and body, a connection limit,
bounded send buffers, and our error shape for what it refuses before the app sees a request."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from transformers_openai.serving.errors import (
    BadRequestError,
    OpenAIError,
    RequestTimeoutError,
    ServiceUnavailableError,
)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


@dataclass(frozen=True)
class ConnectionLimits:
    """Args:
    header_timeout_s: a connection must send a complete request head within this (idle ones are closed).
    body_timeout_s: once the head is in, the whole body must arrive within this.
    max_connections: open connections beyond this get a 503 and are closed.
    send_buffer_bytes: the kernel's send buffer per connection (it doubles it). Small, so that a client that
        stops reading blocks our sends soon and the engine pauses its row: a few hundred chat chunks at most. Token
        streams are small, so even a slow link keeps up within it.
    """

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    send_buffer_bytes: int = 16 * 1024


class GuardedH11Protocol(H11Protocol):
    """One connection. Deadlines are per request: the head deadline starts when the connection opens or when
    the first byte of a later request arrives; the body deadline when the head is complete."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = "head"  # what the armed deadline waits for: the request head or its body
        self._over_limit = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._limits.send_buffer_bytes)
        # A send waits until the kernel has taken all of it: what the socket cannot take stays with the engine
        # (whose flow control then pauses the request's row), not in an unbounded buffer here.
        transport.set_write_buffer_limits(high=0)
        self._over_limit = len(self.connections) > self._limits.max_connections
        self._arm(self._limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._over_limit:  # answer once its request is sent, so the client reads the 503 rather than a reset
            limit = self._limits.max_connections
            self._refuse(ServiceUnavailableError(f"the server has too many open connections ({limit}); retry later"))
            return
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm(self._limits.header_timeout_s)  # the first bytes of a new request on a kept-alive connection
        super().data_received(data)
        self._follow_request()

    def send_400_response(self, msg: str) -> None:
        self._refuse(BadRequestError(f"invalid HTTP request: {msg}", code="invalid_http"))

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase != "body":
            self._arm(self._limits.body_timeout_s, phase="body")
        elif state is not h11.SEND_BODY and state is not h11.IDLE:
            self._disarm()  # the request is in: from here on the app and the stall timeout are in charge

    def _arm(self, seconds: float, phase: str = "head") -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = "head"

    def _late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._phase == "body":
            if self.cycle is None or not self.cycle.response_started:
                seconds = self._limits.body_timeout_s
                self._refuse(RequestTimeoutError(f"the request body did not arrive within {seconds:g}s"))
            else:
                self.transport.close()
        elif self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # connected and silent: nothing to answer
        else:
            seconds = self._limits.header_timeout_s
            self._refuse(RequestTimeoutError(f"the request head did not arrive within {seconds:g}s"))

    def _refuse(self, error: OpenAIError) -> None:
        """Writes our error as a complete HTTP/1.1 response outside h11's state machine, then closes."""
        body = error.body().model_dump_json().encode()
        head = b"".join(
            [
                b"HTTP/1.1 %d %s\r\n" % (error.status_code, _REASONS.get(error.status_code, b"Error")),
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
        )
        self._disarm()
        self.transport.write(head + body)
        self.transport.close()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app, if it runs, sees a disconnect and sends nothing more
            self.cycle.message_event.set()
