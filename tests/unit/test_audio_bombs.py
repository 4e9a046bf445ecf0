"""Decode bombs: small files that would decode or resample to gigabytes are refused from their header, or once
decoding passes the length limit, before the samples they would become are ever held; ordinary files decode to
what librosa's `load` gives."""

from __future__ import annotations

import io
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import librosa
import numpy as np
import pytest
import soundfile

from tests.audio_encoding import low_rate_matroska, low_rate_wav, silent_flac
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.speech import audio
from transformers_openai.serving.speech.audio import MIN_SAMPLE_RATE, decode_audio

RATE = 16000
HOUR = 3600.0
MB = 1 << 20
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int:
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_growth(work: Callable[[], object]) -> int:
    """Bytes the process's resident set rose to above where it was while `work` ran (its peak, reset first)."""
    try:
        CLEAR_REFS.write_text("5")  # resets the peak (VmHWM) to the current resident set
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    before = _status_kb("VmRSS")
    work()
    return (_status_kb("VmHWM") - before) * 1024


def refused(data: bytes, max_seconds: float = HOUR) -> BadRequestError:
    with pytest.raises(BadRequestError) as caught:
        decode_audio(data, RATE, max_seconds, "bomb")
    assert caught.value.status_code == 400 and caught.value.param == "file"
    return caught.value


@pytest.fixture(scope="module")
def two_hours() -> bytes:
    return silent_flac(2 * HOUR)


def flac_of_unknown_length(data: bytes) -> bytes:
    """The FLAC with the total sample count of its STREAMINFO zeroed: 'unknown', as a streaming encoder writes it."""
    out = bytearray(data)
    assert out[:4] == b"fLaC"
    fields = int.from_bytes(out[18:26], "big") & ~((1 << 36) - 1)  # rate, channels, bits, then the 36-bit count
    out[18:26] = fields.to_bytes(8, "big")
    return bytes(out)


def test_the_bombs_are_small() -> None:
    assert len(low_rate_wav()) == 40_000
    assert 0.9 * MB < len(low_rate_matroska()) < 1.1 * MB


def test_a_wav_at_one_hertz_is_refused_from_its_header() -> None:
    data = low_rate_wav()
    error = refused(data)
    assert error.code == "invalid_audio" and "1 Hz" in error.message and f"{MIN_SAMPLE_RATE} Hz" in error.message
    assert peak_growth(lambda: refused(data)) < 50 * MB


def test_a_low_rate_matroska_is_refused_before_its_frame_is_resampled() -> None:
    data = low_rate_matroska()
    error = refused(data)
    assert error.code == "invalid_audio" and "2 Hz" in error.message
    assert peak_growth(lambda: refused(data)) < 50 * MB


def test_two_hours_of_flac_are_refused_from_the_header(two_hours: bytes) -> None:
    assert len(two_hours) < MB
    error = refused(two_hours)
    assert error.code == "audio_too_long" and "7200.0 s long" in error.message
    assert peak_growth(lambda: refused(two_hours)) < 50 * MB


def test_a_flac_that_does_not_state_its_length_is_refused_once_decoding_passes_the_limit(two_hours: bytes) -> None:
    data = flac_of_unknown_length(two_hours)
    error = refused(data, max_seconds=60)
    assert error.code == "audio_too_long" and "longer than 60 s" in error.message
    # A minute at 16 kHz is 3.7 MiB of samples; the two hours would be 440 MiB.
    assert peak_growth(lambda: refused(data, max_seconds=60)) < 50 * MB


def test_a_frame_past_the_limit_is_refused_before_it_is_resampled(monkeypatch: pytest.MonkeyPatch) -> None:
    import av

    resampled: list[int] = []
    real = av.AudioResampler

    class CountingResampler:
        def __init__(self, **kwargs: Any) -> None:  # handed on to the real resampler as they come
            self.inner = real(**kwargs)

        def resample(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
            resampled.append(0 if frame is None else frame.samples)
            return self.inner.resample(frame)

    monkeypatch.setattr(av, "AudioResampler", CountingResampler)
    monkeypatch.setattr(audio, "_stated_seconds", lambda container, stream: None)  # no length in the header
    # Four 30 s frames at 8 kHz: the second one takes the count past 45 s.
    data = low_rate_matroska(rate=8000, samples=240_000, frames=4)
    error = refused(data, max_seconds=45)
    assert error.code == "audio_too_long"
    assert resampled == [240_000]  # the first frame only


def test_six_bombs_at_once_stay_small(two_hours: bytes) -> None:
    bombs = [low_rate_wav(), low_rate_matroska(), two_hours] * 2
    errors: list[BaseException] = []

    def decode(data: bytes) -> None:
        try:
            decode_audio(data, RATE, HOUR, "bomb")
        except BaseException as exc:  # noqa: BLE001 (collected for the assertion below)
            errors.append(exc)

    def all_at_once() -> None:
        threads = [threading.Thread(target=decode, args=(data,)) for data in bombs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    assert peak_growth(all_at_once) < 50 * MB
    assert len(errors) == 6 and all(isinstance(e, BadRequestError) and e.status_code == 400 for e in errors)


@pytest.mark.parametrize(("rate", "channels"), [(44100, 2), (22050, 1), (8000, 1), (48000, 6), (RATE, 2)])
def test_block_by_block_equals_librosa_whole(rate: int, channels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audio, "BLOCK_SAMPLES", 40_000)  # many blocks, and seams inside the resampler's filter
    noise = np.random.default_rng(rate + channels).standard_normal((rate * 3 + 17, channels)) * 0.1
    buffer = io.BytesIO()
    soundfile.write(buffer, noise.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    expected, _ = librosa.load(io.BytesIO(buffer.getvalue()), sr=RATE, mono=True)
    samples = decode_audio(buffer.getvalue(), RATE, HOUR)
    assert samples.dtype == np.float32 and samples.shape == expected.shape
    np.testing.assert_allclose(samples, expected, rtol=0, atol=1e-6)


def upload(spooled: tempfile.SpooledTemporaryFile[bytes]) -> BinaryIO:
    """The spooled file as Starlette's UploadFile.file hands it on (typed BinaryIO there)."""
    return cast(BinaryIO, spooled)


def test_a_spooled_upload_decodes_like_its_bytes(audio_dir: Path) -> None:
    data = (audio_dir / "flite-s1.wav").read_bytes()
    with tempfile.SpooledTemporaryFile(max_size=1024) as spooled:  # past 1 KB: on disk, as Starlette spools
        spooled.write(data)
        spooled.seek(0)
        np.testing.assert_array_equal(decode_audio(upload(spooled), RATE, 60), decode_audio(data, RATE, 60))


def test_an_empty_spooled_upload_is_refused() -> None:
    with tempfile.SpooledTemporaryFile() as spooled, pytest.raises(BadRequestError, match="is empty"):
        decode_audio(upload(spooled), RATE, 60, "empty.wav")
