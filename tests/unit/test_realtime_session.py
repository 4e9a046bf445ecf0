"""A realtime transcription session without a model: its events, its turns (cut by server VAD or by commits), and
its answers to malformed events and to too much audio. The transcription handler is a stand-in that reports the
audio each turn sent it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import soundfile

from transformers_openai.protocol.audio import (
    DurationUsage,
    TranscriptionRequest,
    TranscriptTextDelta,
    TranscriptTextDone,
)
from transformers_openai.protocol.realtime_events import ServerEvent
from transformers_openai.serving.disconnect import WaitDisconnect
from transformers_openai.serving.errors import ModelNotFoundError
from transformers_openai.serving.speech.realtime import RealtimeLimits, RealtimeSession
from transformers_openai.serving.speech.voice_activity import VoiceActivity

RATE = 24000


class Harness:
    """A session, the events it sent, and the turns its stand-in handler was given."""

    def __init__(self, max_buffer_seconds: float = 10.0) -> None:
        self.events: list[dict[str, Any]] = []
        self.turns: list[tuple[TranscriptionRequest, np.ndarray, int]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.session = RealtimeSession(
            self._create, self._check_model, "test-model", RealtimeLimits(max_buffer_seconds), self._send
        )

    async def _send(self, event: ServerEvent) -> None:
        self.events.append(json.loads(event.model_dump_json()))

    def _check_model(self, name: str) -> None:
        if name != "test-model":
            raise ModelNotFoundError(f"the model '{name}' does not exist", param="model")

    async def _create(self, request: TranscriptionRequest, wait: WaitDisconnect, item: str) -> AsyncIterator[Any]:
        assert not isinstance(request.audio, bytes)
        samples, rate = soundfile.read(request.audio, dtype="int16")
        self.turns.append((request, samples, rate))

        async def events() -> AsyncIterator[Any]:
            yield TranscriptTextDelta(delta="heard")
            await self.hold.wait()
            yield TranscriptTextDone(text=f"heard {samples.size}", usage=DurationUsage(seconds=1))

        return events()

    async def send(self, **event: Any) -> None:
        await self.session.receive(json.dumps(event))

    async def append(self, samples: np.ndarray, chunk: int = 2400) -> None:
        pcm = samples.astype("<i2").tobytes()
        for at in range(0, len(pcm), chunk * 2):
            await self.send(type="input_audio_buffer.append", audio=base64.b64encode(pcm[at : at + chunk * 2]).decode())

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    def types(self) -> list[str]:
        return [event["type"] for event in self.events]

    def errors(self) -> list[dict[str, Any]]:
        return [event["error"] for event in self.events if event["type"] == "error"]


def tone(seconds: float, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * 32767 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.int16)


async def test_server_vad_cuts_a_turn_and_transcribes_it() -> None:
    h = Harness()
    await h.session.open()
    await h.append(np.concatenate([silence(1.0), tone(1.0), silence(1.0)]))
    await h.settle()
    assert h.types() == [
        "transcription_session.created",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.created",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
    ]
    started, stopped, committed, created, delta, completed = h.events[1:]
    assert started["audio_start_ms"] == 1000 and stopped["audio_end_ms"] == 2000
    item = started["item_id"]
    assert stopped["item_id"] == committed["item_id"] == created["item"]["id"] == delta["item_id"] == item
    assert committed["previous_item_id"] is None and completed["item_id"] == item
    # The turn: 300 ms of padding before the speech, the speech, and the 500 ms of silence that ended it.
    ((request, samples, rate),) = h.turns
    assert rate == RATE and samples.size == int(1.8 * RATE)
    assert request.stream and not request.fallback and request.temperature == 0.0 and request.model == "test-model"
    assert completed["transcript"] == f"heard {samples.size}"


async def test_manual_commits_chain_items_and_refuse_a_near_empty_buffer() -> None:
    h = Harness()
    await h.send(type="transcription_session.update", session={"turn_detection": None, "input_audio_format": "pcm16"})
    assert h.events[-1]["type"] == "transcription_session.updated"
    assert h.events[-1]["session"]["turn_detection"] is None
    await h.append(silence(0.05))
    await h.send(type="input_audio_buffer.commit", event_id="c1")
    assert h.errors()[-1]["code"] == "input_audio_buffer_commit_empty" and h.errors()[-1]["event_id"] == "c1"
    await h.append(np.concatenate([tone(0.5), silence(0.5)]))  # no VAD: silence does not end the turn
    assert "input_audio_buffer.committed" not in h.types()
    await h.send(type="input_audio_buffer.commit")
    await h.append(tone(0.2))
    await h.send(type="input_audio_buffer.commit")
    await h.settle()
    committed = [event for event in h.events if event["type"] == "input_audio_buffer.committed"]
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    assert [samples.size for _, samples, _ in h.turns] == [int(1.05 * RATE), int(0.2 * RATE)]


async def test_clear_drops_the_buffer() -> None:
    h = Harness()
    await h.send(type="transcription_session.update", session={"turn_detection": None})
    await h.append(tone(0.5))
    await h.send(type="input_audio_buffer.clear")
    assert h.types()[-1] == "input_audio_buffer.cleared"
    await h.send(type="input_audio_buffer.commit")
    assert h.errors()[-1]["code"] == "input_audio_buffer_commit_empty"


@pytest.mark.parametrize(
    ("message", "code", "param"),
    [
        ("not json", "invalid_json", None),
        ("[1, 2]", "invalid_event", "type"),
        ('{"type": "response.create"}', "invalid_event", "type"),
        ('{"type": "input_audio_buffer.append"}', "invalid_event", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_audio", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "AA=="}', "invalid_audio", "audio"),  # one byte: half a sample
        ('{"type": "input_audio_buffer.append", "audio": "AA==", "extra": 1}', "invalid_event", "extra"),
        (
            '{"type": "transcription_session.update", "session": {"turn_detection": {"type": "semantic_vad"}}}',
            "invalid_event",
            "session.turn_detection.type",
        ),
        (
            '{"type": "transcription_session.update", "session": {"input_audio_format": "mp3"}}',
            "invalid_event",
            "session.input_audio_format",
        ),
        (
            '{"type": "transcription_session.update", "session": {"turn_detection": {"threshold": 2}}}',
            "invalid_event",
            "session.turn_detection.threshold",
        ),
        ('{"type": "session.update", "session": {"type": "realtime"}}', "invalid_event", "session.type"),
        (
            '{"type": "transcription_session.update", "session": {"turn_detection": {"threshold": "0.5"}}}',
            "invalid_event",
            "session.turn_detection.threshold",
        ),
        ('{"type": "input_audio_buffer.commit", "event_id": NaN}', "invalid_event", "event_id"),
        ("[" * 100_000 + "]" * 100_000, "invalid_json", None),
    ],
)
async def test_a_malformed_event_gets_an_error_event_naming_it_and_the_session_goes_on(
    message: str, code: str, param: str | None
) -> None:
    h = Harness()
    await h.session.receive(message)
    (error,) = h.errors()
    assert error["code"] == code and error["param"] == param and error["type"] == "invalid_request_error", error
    await h.send(type="transcription_session.update", session={})
    assert h.types()[-1] == "transcription_session.updated"


async def test_an_unknown_model_is_refused_on_update() -> None:
    h = Harness()
    await h.send(type="transcription_session.update", session={"input_audio_transcription": {"model": "whisper-9"}})
    (error,) = h.errors()
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    assert "whisper-9" in error["message"] and error["param"] == "model"


async def test_audio_past_the_buffer_bound_is_refused() -> None:
    h = Harness(max_buffer_seconds=1.0)
    await h.send(type="transcription_session.update", session={"turn_detection": None})
    await h.append(tone(0.9), chunk=int(0.3 * RATE))
    await h.append(tone(0.3), chunk=int(0.3 * RATE))
    (error,) = h.errors()
    assert error["code"] == "input_audio_buffer_full" and error["param"] == "audio"
    await h.send(type="input_audio_buffer.commit")  # the refused chunk is not in the turn
    await h.settle()
    assert [samples.size for _, samples, _ in h.turns] == [int(0.9 * RATE)]


async def test_the_ga_session_shape_and_g711_audio() -> None:
    h = Harness()
    session = {
        "type": "transcription",
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "transcription": {"language": "en"}, "turn_detection": None}
        },
    }
    await h.send(type="session.update", session=session)
    shown = h.events[-1]
    assert shown["type"] == "session.updated"
    assert shown["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert shown["session"]["audio"]["input"]["transcription"]["language"] == "en"
    ulaw = bytes([0xFF, 0x7F, 0x80, 0x00] * 400)  # silence twice, then the loudest of each sign
    await h.send(type="input_audio_buffer.append", audio=base64.b64encode(ulaw).decode())
    await h.send(type="input_audio_buffer.commit")
    await h.settle()
    ((request, samples, rate),) = h.turns
    assert rate == 8000 and request.language == "en"
    assert samples[:4].tolist()[:2] == [0, 0] and samples[2] > 30000 and samples[3] < -30000


async def test_closing_cancels_the_turns_in_flight() -> None:
    h = Harness()
    h.hold.clear()  # the stand-in handler never finishes its turn
    await h.send(type="transcription_session.update", session={"turn_detection": None})
    await h.append(tone(0.5))
    await h.send(type="input_audio_buffer.commit")
    await h.settle()
    assert h.types()[-1] == "conversation.item.input_audio_transcription.delta"
    await asyncio.wait_for(h.session.close(), 1)
    assert "conversation.item.input_audio_transcription.completed" not in h.types()


def test_voice_activity_ignores_clicks_and_quiet_noise() -> None:
    vad = VoiceActivity(RATE, threshold=0.5, silence_duration_ms=300, prefix_padding_ms=0)
    noise = (np.random.default_rng(0).normal(0, 100, RATE)).astype(np.int16)  # about -50 dBFS
    click = np.zeros(RATE // 10, dtype=np.int16)
    click[:240] = 20000  # one loud 10 ms frame
    assert vad.feed(noise) == [] and vad.feed(click) == []
    assert [event.kind for event in vad.feed(np.concatenate([tone(0.5, 0.05), silence(0.5)]))] == ["start", "stop"]
