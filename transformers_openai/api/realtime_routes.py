"""/v1/realtime?intent=transcription: a WebSocket carrying a realtime transcription session's JSON events.

A connection the server cannot take (another intent, a model not served or not a speech model, every session slot
taken) is refused at the handshake with an HTTP error in OpenAI's shape. An open session is closed when its client
leaves (its turns' engine rows are aborted at once) or sends nothing for the idle timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from transformers_openai.api.errors import error_response
from transformers_openai.api.handlers import Handlers
from transformers_openai.api.state import AppState
from transformers_openai.protocol.realtime_events import ErrorEvent, EventError, ServerEvent
from transformers_openai.serving.disconnect import ClientDisconnected
from transformers_openai.serving.errors import BadRequestError, OpenAIError, RateLimitError
from transformers_openai.serving.speech.realtime import RealtimeLimits, RealtimeSession

logger = logging.getLogger(__name__)

SUBPROTOCOL = "realtime"  # what OpenAI's browser clients offer first; echoed when offered
GOING_AWAY = 1001


@dataclass
class RealtimeSlots:
    """The realtime sessions open at once, against `--max-realtime-sessions`."""

    limit: int
    open: int = field(default=0)

    def take(self) -> None:
        if self.open >= self.limit:
            raise RateLimitError(f"this server holds at most {self.limit} realtime sessions at once; retry later")
        self.open += 1

    def give_back(self) -> None:
        self.open -= 1


def build_realtime_router() -> APIRouter:
    router = APIRouter()

    @router.websocket("/realtime")
    async def realtime(websocket: WebSocket, intent: str | None = None, model: str | None = None) -> None:
        state: AppState = websocket.app.state.serving
        try:
            _check_intent(intent)
            held = await state.acquire(model)  # the model stays loaded while the session is open
        except OpenAIError as exc:
            await websocket.send_denial_response(error_response(exc, websocket.url.path))
            return
        try:
            try:
                assert held.handlers is not None  # a held model stays loaded
                session = _open_session(websocket, held.handlers, model)
            except OpenAIError as exc:
                await websocket.send_denial_response(error_response(exc, websocket.url.path))
                return
            slots: RealtimeSlots = websocket.app.state.realtime_slots
            try:
                await _serve(websocket, session, websocket.app.state.settings.realtime_idle_timeout)
            finally:
                slots.give_back()
        finally:
            state.registry.release(held)

    return router


def _check_intent(intent: str | None) -> None:
    if intent is not None and intent != "transcription":
        raise BadRequestError(
            f"intent '{intent[:40]}' is not served: this server runs transcription sessions (intent=transcription)",
            param="intent",
        )


def _open_session(websocket: WebSocket, handlers: Handlers, model: str | None) -> RealtimeSession:
    """The session for this connection on the model it names, or the error that refuses it (the slot is taken
    last)."""
    handler = handlers.transcriptions
    if model is not None:
        handler.ctx.check_model(model)
    settings = websocket.app.state.settings
    limits = RealtimeLimits(max_buffer_seconds=settings.realtime_max_buffer_seconds)
    lock = asyncio.Lock()

    async def send(event: ServerEvent) -> None:
        async with lock:
            try:
                await websocket.send_text(event.model_dump_json())
            except WebSocketDisconnect:
                raise ClientDisconnected("realtime session") from None  # a turn's send: the session ends quietly

    session = RealtimeSession(handler.create, handler.ctx.check_model, model or handler.ctx.model_name, limits, send)
    websocket.app.state.realtime_slots.take()
    return session


async def _serve(websocket: WebSocket, session: RealtimeSession, idle_timeout: float) -> None:
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    try:
        await session.open()
        while True:
            try:
                message = await asyncio.wait_for(websocket.receive(), idle_timeout)
            except TimeoutError:
                await _close_idle(websocket, session, idle_timeout)
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                await session.refuse(
                    BadRequestError("binary frames are not events: send each event as JSON text", code="invalid_event")
                )
                continue
            await session.receive(text)
    except (WebSocketDisconnect, ClientDisconnected):
        return
    finally:
        await session.close()


async def _close_idle(websocket: WebSocket, session: RealtimeSession, idle_timeout: float) -> None:
    error = EventError(
        message=f"the session sent no event for {idle_timeout:g} s and is closed",
        type="invalid_request_error",
        code="session_idle_timeout",
    )
    with contextlib.suppress(Exception):
        await session.close()
        if websocket.client_state is WebSocketState.CONNECTED:
            await websocket.send_text(ErrorEvent(error=error).model_dump_json())
            await websocket.close(GOING_AWAY)
