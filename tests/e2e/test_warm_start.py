"""What a first request of a kind would build is built at start-up: the first structured-output request does not
freeze running streams, and the first structured answer and the first transcription take as long as later ones."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server

AUDIO = Path(__file__).resolve().parents[1] / "data" / "audio" / "flite-s1.wav"
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}},
            "required": ["name"],
        },
    },
}


@pytest.fixture
def fresh_tiny(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs)
    yield server
    server.stop()


def structured(server: ServerProcess) -> float:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "A city?"}],
        "max_tokens": 30,
        "temperature": 0,
        "response_format": SCHEMA,
    }
    start = time.monotonic()
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]
    if answer["finish_reason"] == "stop":
        assert isinstance(json.loads(answer["message"]["content"]), dict)
    return time.monotonic() - start


def test_the_first_structured_request_does_not_freeze_running_streams(fresh_tiny: ServerProcess) -> None:
    body = {
        "model": fresh_tiny.model,
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    side: list[float] = []
    with httpx.stream("POST", f"{fresh_tiny.base_url}/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 50:  # the stream runs: now the process's first structured request
                sender = threading.Thread(target=lambda: side.append(structured(fresh_tiny)))
                sender.start()
    sender.join(60)
    assert side, "the structured request did not finish"
    gaps = [b - a for a, b in zip(arrivals[50:], arrivals[51:], strict=False)]
    assert len(gaps) > 100 and max(gaps) < 0.5, max(gaps)


@pytest.mark.slow
def test_the_first_structured_answer_is_as_quick_as_later_ones(fresh_tiny: ServerProcess) -> None:
    first = structured(fresh_tiny)
    later = min(structured(fresh_tiny) for _ in range(2))
    assert first - later < 3.0, (first, later)


@pytest.mark.slow
def test_the_first_transcription_is_as_quick_as_later_ones(whisper_dir: Path, server_logs: Path) -> None:
    server = start_server(whisper_dir, server_logs)
    try:

        def transcribe() -> float:
            start = time.monotonic()
            with AUDIO.open("rb") as audio:
                response = httpx.post(
                    f"{server.base_url}/audio/transcriptions",
                    data={"model": server.model},
                    files={"file": (AUDIO.name, audio, "audio/wav")},
                    timeout=120,
                )
            assert response.status_code == 200 and response.json()["text"].strip(), response.text
            return time.monotonic() - start

        first = transcribe()
        later = min(transcribe() for _ in range(2))
    finally:
        server.stop()
    assert first - later < 3.0, (first, later)
