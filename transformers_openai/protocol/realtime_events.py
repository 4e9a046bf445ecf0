"""Realtime transcription sessions: the server events, as OpenAI's realtime API shapes them."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from transformers_openai.protocol.audio import DurationUsage
from transformers_openai.protocol.common import ErrorBody


def _event_id() -> str:
    return f"event_{uuid.uuid4().hex[:24]}"


class ServerEvent(BaseModel):
    event_id: str = Field(default_factory=_event_id)


class SessionEvent(ServerEvent):
    """The session as it stands: on connecting, and after each update (in the shape the update used)."""

    type: Literal[
        "transcription_session.created", "transcription_session.updated", "session.created", "session.updated"
    ]
    session: dict[str, Any]


class BufferCommitted(ServerEvent):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    previous_item_id: str | None
    item_id: str


class BufferCleared(ServerEvent):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


class SpeechStarted(ServerEvent):
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    audio_start_ms: int  # from the start of the session's audio
    item_id: str


class SpeechStopped(ServerEvent):
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


class InputAudioContent(BaseModel):
    type: Literal["input_audio"] = "input_audio"
    transcript: str | None = None


class Item(BaseModel):
    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["message"] = "message"
    status: Literal["completed"] = "completed"
    role: Literal["user"] = "user"
    content: list[InputAudioContent] = Field(default_factory=lambda: [InputAudioContent()])


class ItemCreated(ServerEvent):
    type: Literal["conversation.item.created"] = "conversation.item.created"
    previous_item_id: str | None
    item: Item


class TranscriptionDelta(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.delta"] = (
        "conversation.item.input_audio_transcription.delta"
    )
    item_id: str
    content_index: int = 0
    delta: str


class TranscriptionCompleted(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.completed"] = (
        "conversation.item.input_audio_transcription.completed"
    )
    item_id: str
    content_index: int = 0
    transcript: str
    usage: DurationUsage


class TranscriptionFailed(ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.failed"] = (
        "conversation.item.input_audio_transcription.failed"
    )
    item_id: str
    content_index: int = 0
    error: ErrorBody


class EventError(ErrorBody):
    event_id: str | None = None  # the client event that caused it


class ErrorEvent(ServerEvent):
    type: Literal["error"] = "error"
    error: EventError
