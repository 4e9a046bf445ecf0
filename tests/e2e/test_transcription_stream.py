"""Whisper tiny.en streamed token by token (temperature given: no fallback): a word per delta from the first
decode steps, joined to exactly the non-streamed text; the openai client reads every event. (Long audio streamed:
test_transcription.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.audio import TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "test-model"
CLIP = "flite-s4.wav"  # 3.9 s, one sentence: the longest of the short clips


def engine_steps(client: httpx.Client, server: ServerProcess) -> float:
    """The engine's steps so far, from /metrics."""
    for line in client.get(f"{server.root_url}/metrics").text.splitlines():
        if line.startswith("transformers_openai:engine_step_phase_seconds_count") and 'phase="total"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no engine step counter in /metrics")


def stream_counting_steps(
    server: ServerProcess, clip: Path, response_format: str = "json"
) -> tuple[list[dict[str, Any]], float, float]:
    """The events of a streamed transcription (temperature 0, so no fallback), the engine steps it took until its
    first delta came, and the steps it took in all (the server runs nothing else meanwhile)."""
    events: list[dict[str, Any]] = []
    with httpx.Client(timeout=60) as client:
        before = engine_steps(client, server)
        first = None
        with client.stream(
            "POST",
            f"{server.base_url}/audio/transcriptions",
            files={"file": clip.open("rb")},
            data={"model": MODEL, "stream": "true", "temperature": "0", "response_format": response_format},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if first is None and events[-1]["type"] == "transcript.text.delta":
                        first = engine_steps(client, server)
        total = engine_steps(client, server) - before
    assert first is not None
    return events, first - before, total


def test_a_short_clip_streams_a_delta_per_word_from_its_first_steps(
    whisper_server: ServerProcess, audio_dir: Path
) -> None:
    clip = audio_dir / CLIP
    with clip.open("rb") as f:
        plain = sync_client(whisper_server).audio.transcriptions.create(model=MODEL, file=f, temperature=0).text
    events, to_first, total = stream_counting_steps(whisper_server, clip)
    *deltas, done = events
    assert {e["type"] for e in deltas} == {"transcript.text.delta"} and done["type"] == "transcript.text.done"
    texts = [e["delta"] for e in deltas]
    assert len(texts) >= len(plain.split()) and "".join(texts) == done["text"] == plain
    assert texts[0] == plain.split()[0]
    assert 0 < to_first <= total / 4, (to_first, total)  # the steps of decoding a quarter of the clip
    # The openai client's own reader types every event.
    with clip.open("rb") as f:
        read = list(
            sync_client(whisper_server).audio.transcriptions.create(model=MODEL, file=f, temperature=0, stream=True)
        )
    typed = [e for e in read[:-1] if isinstance(e, TranscriptionTextDeltaEvent)]
    assert len(typed) == len(read) - 1 and isinstance(read[-1], TranscriptionTextDoneEvent)
    assert [e.delta for e in typed] == texts and read[-1].text == plain
