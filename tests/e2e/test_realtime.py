"""Realtime transcription sessions on Whisper tiny.en: eight live sessions at once through one engine, each turn's
transcript equal to the upload's; a session that vanishes mid-turn frees its rows; the session bound."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
import websockets
from loadtest.realtime_bench import RATE, SessionLog, Turn, pcm24k, speak
from openai.types.realtime import (
    ConversationItemInputAudioTranscriptionCompletedEvent,
    ConversationItemInputAudioTranscriptionDeltaEvent,
)

from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "test-model"
CLIPS = ["flite-s1.wav", "flite-s2.wav", "flite-s3.wav", "flite-s4.wav"]
LEAD_S = 0.5  # silence before each clip


def ws_url(server: ServerProcess) -> str:
    return server.root_url.replace("http://", "ws://", 1) + "/v1/realtime?intent=transcription"


def metric(server: ServerProcess, name: str, label: str = "") -> float:
    """One sample of the server's /metrics (0 when it has none yet), its labels holding `label`."""
    for line in httpx.get(f"{server.root_url}/metrics").text.splitlines():
        if line.startswith(f"transformers_openai:{name}{{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def uploaded_text(server: ServerProcess, pcm: bytes, model: str = MODEL) -> str:
    """The non-streamed transcription of the same 24 kHz audio, uploaded as a WAV file with temperature 0 (a turn
    is decoded at that one temperature, so that no retry takes back the text its deltas sent)."""
    wav = io.BytesIO()
    soundfile.write(wav, np.frombuffer(pcm, dtype="<i2"), RATE, format="WAV", subtype="PCM_16")
    wav.name = "turn.wav"
    wav.seek(0)
    return (await async_client(server).audio.transcriptions.create(model=model, file=wav, temperature=0)).text


def turn_audio(spoken: bytes, turn: Turn) -> bytes:
    """What server VAD committed: from the speech's start less the padding to its end plus the silence that ended
    it (the session defaults: 300 ms and 500 ms)."""
    assert turn.start_ms is not None and turn.end_ms is not None
    per_ms = 2 * RATE // 1000
    return spoken[(turn.start_ms - 300) * per_ms : (turn.end_ms + 500) * per_ms]


def test_eight_sessions_share_decode_steps_and_match_uploads(whisper_server: ServerProcess, audio_dir: Path) -> None:
    clips = [pcm24k(audio_dir / name) for name in CLIPS]
    url = ws_url(whisper_server)
    before = [metric(whisper_server, "batch_size_sum"), metric(whisper_server, "batch_size_count")]

    async def sessions() -> list[SessionLog]:
        # Twice real time: the assertions are about what is decoded and how, not about keeping pace.
        return list(await asyncio.gather(*(speak(url, [clips[i % 4]], pace=2.0, lead_s=LEAD_S) for i in range(8))))

    logs = asyncio.run(sessions())
    rows = metric(whisper_server, "batch_size_sum") - before[0]
    steps = metric(whisper_server, "batch_size_count") - before[1]
    turns = []
    for log in logs:
        types = [event["type"] for event in log.events]
        assert types[:4] == [
            "transcription_session.created",
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
        ], types
        (turn,) = log.turns
        assert turn.transcript is not None and "".join(turn.deltas) == turn.transcript
        assert len(turn.deltas) >= len(turn.transcript.split())
        turns.append(turn)
    # Rows advanced over decode steps: the eight turns shared the engine's steps.
    tokens = sum(len(turn.deltas) for turn in turns)
    assert rows >= tokens and steps * 2 <= rows, (rows, steps, tokens)

    spoken = [bytes(2 * int(LEAD_S * RATE)) + clips[i % 4] + bytes(2 * RATE) for i in range(8)]
    audio = [turn_audio(spoken[i], turn) for i, turn in enumerate(turns)]

    async def uploads() -> dict[bytes, str]:
        distinct = list(dict.fromkeys(audio))
        texts = await asyncio.gather(*(uploaded_text(whisper_server, pcm) for pcm in distinct))
        return dict(zip(distinct, texts, strict=True))

    expected = asyncio.run(uploads())
    assert [turn.transcript for turn in turns] == [expected[pcm] for pcm in audio]


def test_a_session_that_vanishes_mid_turn_frees_its_rows(whisper_server: ServerProcess, audio_dir: Path) -> None:
    long_clip = pcm24k(audio_dir / "librispeech-7021-79759-0004.wav")
    chunk = 2 * RATE  # a second of audio per event

    async def vanish() -> None:
        async with websockets.connect(ws_url(whisper_server), max_size=None) as ws:
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {"turn_detection": None}}))
            for at in range(0, len(long_clip), chunk):
                piece = long_clip[at : at + chunk]
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()})
                )
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            async for message in ws:
                if json.loads(message)["type"].endswith("transcription.delta"):
                    break
            assert metric(whisper_server, "num_requests_running") == 1
            ws.transport.abort()  # gone without a close frame

    aborted = 'finished_reason="abort"'
    before = metric(whisper_server, "request_success_total", aborted)
    asyncio.run(vanish())
    deadline = time.monotonic() + 10
    while metric(whisper_server, "num_requests_running") > 0:
        assert time.monotonic() < deadline, "the vanished session's rows are still running"
        time.sleep(0.05)
    assert metric(whisper_server, "request_success_total", aborted) == before + 1


def test_the_openai_clients_realtime_connection_reads_every_event(
    whisper_server: ServerProcess, audio_dir: Path
) -> None:
    """The openai client's own realtime connection (GA `session.update`, manual commits) types every event."""
    clip = pcm24k(audio_dir / "flite-s1.wav")

    async def session() -> list[Any]:
        client = async_client(whisper_server)
        query = {"intent": "transcription"}
        async with client.realtime.connect(model=MODEL, extra_query=query) as connection:
            update = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}
            await connection.session.update(session=update)  # type: ignore[arg-type]
            await connection.input_audio_buffer.append(audio=base64.b64encode(clip).decode())
            await connection.input_audio_buffer.commit()
            events = []
            async for event in connection:
                events.append(event)
                if event.type == "conversation.item.input_audio_transcription.completed":
                    return events
        raise AssertionError("the connection closed before the transcript")

    events = asyncio.run(session())
    assert [event.type for event in events][1:4] == [
        "session.updated",
        "input_audio_buffer.committed",
        "conversation.item.created",
    ]
    deltas = [event for event in events if isinstance(event, ConversationItemInputAudioTranscriptionDeltaEvent)]
    done = events[-1]
    assert isinstance(done, ConversationItemInputAudioTranscriptionCompletedEvent)
    assert deltas and "".join(event.delta or "" for event in deltas) == done.transcript
    assert done.transcript == asyncio.run(uploaded_text(whisper_server, clip))


def test_sessions_past_the_bound_are_refused_at_the_handshake(whisper_server: ServerProcess) -> None:
    async def fill() -> None:
        opened = [await websockets.connect(ws_url(whisper_server)) for _ in range(16)]  # --max-realtime-sessions
        try:
            for ws in opened:
                assert json.loads(await ws.recv())["type"] == "transcription_session.created"
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(ws_url(whisper_server))
            response = refused.value.response
            assert response.status_code == 429
            assert json.loads(response.body or b"{}")["error"]["type"] == "rate_limit_error"
            await opened.pop().close()
            await asyncio.sleep(0.2)
            async with websockets.connect(ws_url(whisper_server)) as again:
                assert json.loads(await again.recv())["type"] == "transcription_session.created"
        finally:
            for ws in opened:
                await ws.close()

    asyncio.run(fill())


def test_another_intent_or_model_is_refused(whisper_server: ServerProcess) -> None:
    async def refused(url: str) -> int:
        with pytest.raises(websockets.InvalidStatus) as caught:
            await websockets.connect(url)
        return caught.value.response.status_code

    root = whisper_server.root_url.replace("http://", "ws://", 1)
    assert asyncio.run(refused(f"{root}/realtime?intent=conversation")) == 400
    assert asyncio.run(refused(f"{root}/v1/realtime?intent=transcription&model=whisper-9")) == 404
