"""Realtime transcription sessions: live audio in, a transcript per turn out, through the same engine as uploads.

A session buffers the audio its client appends; voice activity detection on the server (or the client's commit)
cuts it into turns. Each turn goes down the upload path as a short WAV file (resampled to the model's rate, then the
Whisper engine's rows, shared with every other request), streamed token by token with one temperature, so its
deltas are final as they come and its `.completed` text is what a transcription of that audio answers.

The session knows nothing of WebSockets: it takes client events as text and hands server events to `send`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, TypeAdapter, ValidationError

from transformers_openai.protocol.audio import TranscriptionRequest, TranscriptTextDelta, TranscriptTextDone
from transformers_openai.protocol.common import ErrorBody
from transformers_openai.protocol.realtime import (
    AudioAppend,
    AudioClear,
    AudioCommit,
    ClientEvent,
    SessionUpdate,
    TranscriptionSessionUpdate,
)
from transformers_openai.protocol.realtime_events import (
    BufferCleared,
    BufferCommitted,
    ErrorEvent,
    EventError,
    Item,
    ItemCreated,
    ServerEvent,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
    TranscriptionCompleted,
    TranscriptionDelta,
    TranscriptionFailed,
)
from transformers_openai.serving.disconnect import ClientDisconnected, WaitDisconnect
from transformers_openai.serving.errors import BadRequestError, OpenAIError, to_openai_error
from transformers_openai.serving.speech.realtime_buffer import AudioBuffer, decode_chunk, wav_bytes
from transformers_openai.serving.speech.realtime_config import SessionConfig, requested_model
from transformers_openai.serving.speech.voice_activity import FRAME_MS, MIN_SPEECH_FRAMES, VoiceActivity, VoiceEvent

logger = logging.getLogger(__name__)

MIN_COMMIT_MS = 100  # OpenAI's least audio for a commit
SPEECH_ONSET_MS = MIN_SPEECH_FRAMES * FRAME_MS
Send = Callable[[ServerEvent], Awaitable[None]]
Create = Callable[[TranscriptionRequest, WaitDisconnect, str], Awaitable[object]]
_EVENTS: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
_EVENT_TYPES = frozenset(
    [
        "transcription_session.update",
        "session.update",
        *(f"input_audio_buffer.{x}" for x in ("append", "commit", "clear")),
    ]
)


@dataclass(frozen=True)
class RealtimeLimits:
    max_buffer_seconds: float  # audio a session holds uncommitted; an append past it is refused


class RealtimeSession:
    """One client's session. `create` is the transcription handler's; `check_model` refuses a model not served."""

    def __init__(
        self, create: Create, check_model: Callable[[str], None], model: str, limits: RealtimeLimits, send: Send
    ) -> None:
        self.id = f"sess_{uuid.uuid4().hex[:24]}"
        self._create = create
        self._check_model = check_model
        self._limits = limits
        self._send = send
        self._config = SessionConfig(model=model)
        self._buffer = AudioBuffer()
        self._voice = self._new_voice()
        self._item: str | None = None  # the turn being spoken (server VAD)
        self._previous_item: str | None = None
        self._turns: set[asyncio.Task[None]] = set()
        self._closed = asyncio.Event()

    async def open(self) -> None:
        await self._send(SessionEvent(type="transcription_session.created", session=self._config.beta_view(self.id)))

    async def receive(self, message: str) -> None:
        """Handles one client event; a bad one is answered with an `error` event and the session goes on."""
        event_id = None
        try:
            event = self._parse(message)
            event_id = event.event_id
            await self._handle(event)
        except OpenAIError as exc:
            await self._send(ErrorEvent(error=_event_error(exc, event_id)))

    async def _wait_closed(self) -> None:
        await self._closed.wait()

    async def refuse(self, error: OpenAIError) -> None:
        """Answers a message that is no event at all (a binary frame)."""
        await self._send(ErrorEvent(error=_event_error(error, None)))

    async def close(self) -> None:
        """Cancels the turns still transcribing: their engine rows are aborted now."""
        self._closed.set()
        for task in list(self._turns):
            task.cancel()
        await asyncio.gather(*self._turns, return_exceptions=True)

    def _parse(self, message: str) -> ClientEvent:
        try:
            raw = json.loads(message)
        except (ValueError, RecursionError):
            raise BadRequestError("the event is not valid JSON", code="invalid_json") from None
        kind = raw.get("type") if isinstance(raw, dict) else None
        if not isinstance(kind, str):
            raise BadRequestError(
                "an event must be a JSON object with a string 'type'", param="type", code="invalid_event"
            )
        if kind not in _EVENT_TYPES:
            raise BadRequestError(
                f"unknown event type '{kind[:80]}'; a transcription session takes {', '.join(sorted(_EVENT_TYPES))}",
                param="type",
                code="invalid_event",
            )
        try:
            return _EVENTS.validate_json(message)  # strict, as every request: no "0.5" for 0.5
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"][1:])
            raise BadRequestError(
                f"invalid '{kind}' event: {where}: {first['msg']}", param=where or None, code="invalid_event"
            ) from None

    async def _handle(self, event: ClientEvent) -> None:
        if isinstance(event, AudioAppend):
            await self._append(event.audio)
        elif isinstance(event, AudioCommit):
            await self._commit_all()
        elif isinstance(event, AudioClear):
            self._buffer.clear()
            self._item = None
            self._voice = self._new_voice()
            await self._send(BufferCleared())
        else:
            await self._update(event)

    async def _update(self, event: TranscriptionSessionUpdate | SessionUpdate) -> None:
        requested = requested_model(event.session)
        if requested is not None:
            self._check_model(requested)
        before = (self._config.audio_format, self._config.vad)
        if isinstance(event, SessionUpdate):
            self._config.update_ga(event.session)
            shown = SessionEvent(type="session.updated", session=self._config.ga_view(self.id))
        else:
            self._config.update_beta(event.session)
            shown = SessionEvent(type="transcription_session.updated", session=self._config.beta_view(self.id))
        if (self._config.audio_format, self._config.vad) != before:
            if self._config.audio_format != before[0]:
                self._buffer.clear()  # its samples were of the other format
            self._item = None
            self._voice = self._new_voice()
        await self._send(shown)

    def _new_voice(self) -> VoiceActivity | None:
        vad = self._config.vad
        if vad is None:
            return None
        return VoiceActivity(
            self._config.sampling_rate, vad.threshold, vad.silence_duration_ms, vad.prefix_padding_ms, self._buffer.end
        )

    async def _append(self, audio: str) -> None:
        samples = decode_chunk(audio, self._config.audio_format)
        limit = int(self._limits.max_buffer_seconds * self._config.sampling_rate)
        if self._buffer.size + samples.size > limit:
            raise BadRequestError(
                f"the input audio buffer holds at most {self._limits.max_buffer_seconds:g} s of audio; commit it "
                "(or let server VAD end the turn) before appending more",
                param="audio",
                code="input_audio_buffer_full",
            )
        self._buffer.append(samples)
        if self._voice is None:
            return
        for change in self._voice.feed(samples):
            await self._voice_changed(change)
        if not self._voice.speaking and self._config.vad is not None:
            # Speech found in the next chunk may have started in the last frames of this one: keep them too.
            padding = self._config.sampling_rate * (self._config.vad.prefix_padding_ms + SPEECH_ONSET_MS) // 1000
            self._buffer.drop_before(self._voice.position - padding)

    async def _voice_changed(self, change: VoiceEvent) -> None:
        ms = change.position * 1000 // self._config.sampling_rate
        if change.kind == "start":
            self._item = _item_id()
            self._buffer.drop_before(change.cut)
            await self._send(SpeechStarted(audio_start_ms=ms, item_id=self._item))
            return
        item = self._item or _item_id()
        await self._send(SpeechStopped(audio_end_ms=ms, item_id=item))
        await self._commit(self._buffer.take(change.cut), item)

    async def _commit_all(self) -> None:
        least = self._config.sampling_rate * MIN_COMMIT_MS // 1000
        if self._buffer.size < least:
            held = self._buffer.size * 1000 / self._config.sampling_rate
            raise BadRequestError(
                f"buffer too small: a commit needs at least {MIN_COMMIT_MS} ms of audio; it holds {held:.0f} ms",
                code="input_audio_buffer_commit_empty",
            )
        item = self._item or _item_id()
        self._voice = self._new_voice()  # a commit ends any speech in progress
        await self._commit(self._buffer.take(self._buffer.end), item)

    async def _commit(self, samples: np.ndarray, item: str) -> None:
        self._item = None
        previous, self._previous_item = self._previous_item, item
        await self._send(BufferCommitted(previous_item_id=previous, item_id=item))
        await self._send(ItemCreated(previous_item_id=previous, item=Item(id=item)))
        task = asyncio.get_running_loop().create_task(self._transcribe(item, samples, self._config.sampling_rate))
        self._turns.add(task)
        task.add_done_callback(self._turns.discard)

    async def _transcribe(self, item: str, samples: np.ndarray, sampling_rate: int) -> None:
        """One turn down the upload path: its deltas as tokens decode, then the full text."""
        config = self._config
        request = TranscriptionRequest(
            audio=io.BytesIO(wav_bytes(samples, sampling_rate)),
            filename=f"{item}.wav",
            model=config.model,
            language=config.language,
            prompt=config.prompt,
            temperature=0.0,
            fallback=False,  # one temperature: no retry takes back text already sent
            stream=True,
        )
        try:
            events = await self._create(request, self._wait_closed, item)
            assert isinstance(events, AsyncIterator)
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    await self._turn_event(item, event)
        except ClientDisconnected:
            pass
        except Exception as exc:  # the turn failed; the session goes on
            error = to_openai_error(exc)
            if not isinstance(exc, OpenAIError):
                logger.exception("realtime turn %s failed", item)
            body = ErrorBody(message=error.message, type=error.type, param=error.param, code=error.code)
            with contextlib.suppress(Exception):
                await self._send(TranscriptionFailed(item_id=item, error=body))

    async def _turn_event(self, item: str, event: BaseModel) -> None:
        if isinstance(event, TranscriptTextDelta):
            await self._send(TranscriptionDelta(item_id=item, delta=event.delta))
        elif isinstance(event, TranscriptTextDone):
            await self._send(TranscriptionCompleted(item_id=item, transcript=event.text, usage=event.usage))


def _item_id() -> str:
    return f"item_{uuid.uuid4().hex[:24]}"


def _event_error(exc: OpenAIError, event_id: str | None) -> EventError:
    return EventError(message=exc.message, type=exc.type, param=exc.param, code=exc.code, event_id=event_id)
