"""What browsers and phones send (webm/opus, m4a/aac) and the other common containers transcribe like the wav they
came from, decoded without any system ffmpeg."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.audio_encoding import encoded
from tests.e2e.server import ServerProcess, start_server

CLIP = Path(__file__).resolve().parents[1] / "data" / "audio" / "flite-s1.wav"
CONTAINERS = {
    "clip.flac": ("flac", "flac", 16000),
    "clip.ogg": ("ogg", "libopus", 48000),
    "clip.webm": ("webm", "libopus", 48000),
    "clip.m4a": ("ipod", "aac", 16000),
}


@pytest.fixture(scope="module")
def no_ffmpeg_server(whisper_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """Whisper tiny.en in a process whose PATH holds only the virtualenv's programs: no ffmpeg to run."""
    path = str(Path(sys.executable).parent)
    assert shutil.which("ffmpeg", path=path) is None
    server = start_server(whisper_dir, server_logs, env_overrides={"PATH": path})
    yield server
    server.stop()


def transcript(server: ServerProcess, name: str, data: bytes) -> str:
    response = httpx.post(
        f"{server.base_url}/audio/transcriptions",
        data={"model": server.model, "temperature": "0"},
        files={"file": (name, data, "application/octet-stream")},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["text"]).strip()


def test_five_containers_give_the_same_transcript(no_ffmpeg_server: ServerProcess) -> None:
    wav = CLIP.read_bytes()
    reference = transcript(no_ffmpeg_server, "clip.wav", wav)
    assert reference
    for name, (container, codec, rate) in CONTAINERS.items():
        assert transcript(no_ffmpeg_server, name, encoded(wav, container, codec, rate)) == reference, name
