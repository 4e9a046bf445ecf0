"""Audio in: every common container decodes to the same mono 16 kHz samples; bad files get a 400 naming the file."""

from __future__ import annotations

import glob
import io
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.audio_encoding import encoded
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.speech.audio import decode_audio

RATE = 16000
NOISE_BYTES = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def clip(audio_dir: Path) -> bytes:
    return (audio_dir / "flite-s1.wav").read_bytes()


def test_wav_decodes_to_its_samples(clip: bytes) -> None:
    samples = decode_audio(clip, RATE, 60)
    with wave.open(io.BytesIO(clip)) as w:
        assert w.getframerate() == RATE and samples.size == w.getnframes()
    assert samples.dtype == np.float32 and 0.05 < np.abs(samples).max() <= 1.0


CONTAINERS = [
    (".flac", "flac", "flac", RATE),
    (".ogg", "ogg", "vorbis", RATE),
    (".opus", "ogg", "libopus", 48000),
    (".mp3", "mp3", "libmp3lame", RATE),
    (".webm", "webm", "libopus", 48000),  # what browsers' MediaRecorder sends
    (".m4a", "ipod", "aac", RATE),  # what phones send
]


@pytest.mark.parametrize(("suffix", "container", "codec", "rate"), CONTAINERS)
def test_every_container_decodes_to_the_same_sound(
    clip: bytes, suffix: str, container: str, codec: str, rate: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "")  # no system ffmpeg to fall back on
    reference = decode_audio(clip, RATE, 60)
    samples = decode_audio(encoded(clip, container, codec, rate), RATE, 60, f"clip{suffix}")
    assert abs(samples.size - reference.size) < 0.15 * RATE  # codec padding only (AAC's priming: 0.11 s)
    n = min(samples.size, reference.size)
    # Lossy codecs shift and smear: compare loudness envelopes over 50 ms frames.
    frame = RATE // 20
    env = [np.sqrt((np.asarray(x[: n - n % frame]).reshape(-1, frame) ** 2).mean(1)) for x in (reference, samples)]
    assert np.corrcoef(env[0], env[1])[0, 1] > 0.95


def test_a_long_file_is_refused_without_decoding_all_of_it(clip: bytes) -> None:
    webm = encoded(clip, "webm", "libopus", 48000)
    with pytest.raises(BadRequestError) as caught:
        decode_audio(webm, RATE, 1.0, "long.webm")
    assert caught.value.code == "audio_too_long" and "1 s" in caught.value.message


def test_stereo_and_other_rates_become_mono_at_the_model_rate() -> None:
    t = np.arange(44100) / 44100
    left, right = np.sin(2 * np.pi * 440 * t), np.zeros_like(t)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes((np.stack([left, right], 1) * 16000).astype("<i2").tobytes())
    samples = decode_audio(buffer.getvalue(), RATE, 60)
    assert samples.ndim == 1 and abs(samples.size - RATE) <= 1
    assert 0.2 < np.abs(samples).max() < 0.3  # the mean of a 0.49 tone and silence


def empty_wav() -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("empty", b"", "is empty"),
        ("zero-length wav", empty_wav(), "no audio samples"),
        ("text", b"This is not audio at all, just some text.\n" * 20, "could not be decoded"),
        ("truncated header", b"RIFF\x24\x08\x00\x00WAVEfmt ", "could not be decoded"),
        ("random bytes", NOISE_BYTES, "could not be decoded"),
    ],
)
def test_bad_files_get_a_400_that_says_what_is_wrong(name: str, data: bytes, words: str) -> None:
    before = set(glob.glob(str(Path(tempfile.gettempdir()) / "*")))
    with pytest.raises(BadRequestError) as caught:
        decode_audio(data, RATE, 60, "upload.bin")
    error = caught.value
    assert error.status_code == 400 and error.param == "file" and words in str(error), str(error)
    assert "'upload.bin'" in str(error) and "/tmp" not in str(error)
    assert set(glob.glob(str(Path(tempfile.gettempdir()) / "*"))) <= before  # no temporary file left


def test_audio_over_the_length_limit_is_refused(clip: bytes) -> None:
    with pytest.raises(BadRequestError, match="at most 1 s") as caught:
        decode_audio(clip, RATE, 1.0)
    assert caught.value.code == "audio_too_long"
