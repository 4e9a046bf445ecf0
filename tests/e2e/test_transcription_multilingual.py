"""A multilingual Whisper (tiny, random weights): language detection, a chosen language, translation."""

from __future__ import annotations

from pathlib import Path

import httpx
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess

MODEL = "test-model"


def post(server: ServerProcess, route: str, clip: Path, **fields: str) -> httpx.Response:
    with clip.open("rb") as f:
        files = {"file": (clip.name, f.read())}
    data = {"model": MODEL, "response_format": "verbose_json", **fields}
    return httpx.post(f"{server.base_url}/audio/{route}", data=data, files=files, timeout=300)


def test_language_is_detected_or_taken_as_given(multilingual_whisper_server: ServerProcess, audio_dir: Path) -> None:
    clip = audio_dir / "flite-s1.wav"
    detected = post(multilingual_whisper_server, "transcriptions", clip)
    assert detected.status_code == 200, detected.text
    assert detected.json()["language"] in LANGUAGES.values() and detected.json()["task"] == "transcribe"
    german = post(multilingual_whisper_server, "transcriptions", clip, language="de")
    assert german.status_code == 200 and german.json()["language"] == "german"
    assert all(s["tokens"] for s in german.json()["segments"])
    unknown = post(multilingual_whisper_server, "transcriptions", clip, language="xx")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "language"


def test_translation_runs_on_a_multilingual_model(multilingual_whisper_server: ServerProcess, audio_dir: Path) -> None:
    response = post(multilingual_whisper_server, "translations", audio_dir / "flite-s2.wav")
    assert response.status_code == 200, response.text
    assert response.json()["task"] == "translate"
    with (audio_dir / "flite-s2.wav").open("rb") as f:
        text = sync_client(multilingual_whisper_server).audio.translations.create(
            model=MODEL, file=f, response_format="text"
        )
    assert isinstance(text, str)
    assert multilingual_whisper_server.engine_state()["rows_in_use"] == 0
