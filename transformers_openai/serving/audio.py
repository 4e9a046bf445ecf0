"""Audio bytes in, mono float samples at the model's rate out: librosa (libsndfile), ffmpeg for the rest."""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
import tempfile

import numpy as np

from transformers_openai.serving.errors import BadRequestError

logger = logging.getLogger(__name__)

_FFMPEG_TIMEOUT_S = 120.0


def decode_audio(data: bytes, sampling_rate: int, max_seconds: float, filename: str = "") -> np.ndarray:
    """Decodes an uploaded file (wav, flac, mp3, ogg/opus, webm, m4a, ...) to mono float32 at `sampling_rate`.

    Blocking: call it in a worker thread. Raises `BadRequestError` (param `file`) for an empty, truncated,
    silent-length or undecodable file and for audio longer than `max_seconds`.
    """
    name = f"'{filename}'" if filename else "the file"
    if not data:
        raise BadRequestError(f"{name} is empty: upload an audio file", param="file", code="invalid_audio")
    samples = _with_libsndfile(data, sampling_rate)
    if samples is None:
        samples = _with_ffmpeg(data, sampling_rate, name)
    if samples.size == 0:
        raise BadRequestError(f"{name} holds no audio samples", param="file", code="invalid_audio")
    if not np.isfinite(samples).all():
        raise BadRequestError(f"{name} holds samples that are not finite numbers", param="file", code="invalid_audio")
    seconds = samples.size / sampling_rate
    if seconds > max_seconds:
        raise BadRequestError(
            f"{name} is {seconds:.1f} s long; this server takes at most {max_seconds:g} s of audio per request",
            param="file",
            code="audio_too_long",
        )
    return samples


def warm_up_decoder(sampling_rate: int) -> None:
    """Decodes a short generated clip once, resampling it, so that the first upload does not pay for loading and
    compiling the decoders (librosa's first call takes seconds)."""
    import soundfile

    rate = 22050 if sampling_rate != 22050 else 44100
    clip = io.BytesIO()
    soundfile.write(clip, np.sin(np.linspace(0, 440 * 2 * np.pi, rate)).astype(np.float32), rate, format="WAV")
    decode_audio(clip.getvalue(), sampling_rate, max_seconds=60.0)


def _with_libsndfile(data: bytes, sampling_rate: int) -> np.ndarray | None:
    """wav, flac, ogg/vorbis/opus and mp3 through libsndfile; None for what it cannot read."""
    import librosa
    import soundfile

    try:
        samples, _ = librosa.load(io.BytesIO(data), sr=sampling_rate, mono=True)
    except (soundfile.LibsndfileError, RuntimeError, ValueError, EOFError, TypeError):
        return None
    return np.asarray(samples, dtype=np.float32)


def _with_ffmpeg(data: bytes, sampling_rate: int, name: str) -> np.ndarray:
    """Everything else (webm, m4a/mp4, ...): ffmpeg reads a temporary file (mp4 needs to seek), writes raw floats."""
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        raise BadRequestError(
            f"{name} is not in a format this server can read without ffmpeg (wav, flac, ogg and mp3 work)",
            param="file",
            code="invalid_audio",
        )
    with tempfile.NamedTemporaryFile(prefix="toa-audio-") as source:
        source.write(data)
        source.flush()
        command = [ffmpeg, "-nostdin", "-v", "error", "-i", source.name, "-f", "f32le", "-ac", "1",
                   "-ar", str(sampling_rate), "-"]
        try:
            done = subprocess.run(command, capture_output=True, timeout=_FFMPEG_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise BadRequestError(f"{name} took too long to decode", param="file", code="invalid_audio") from exc
    if done.returncode != 0:
        reason = done.stderr.decode("utf-8", "replace").replace(source.name, "input").strip().splitlines()
        detail = reason[-1][:200] if reason else "unknown format"
        logger.info("ffmpeg could not decode %s: %s", name, detail)
        raise BadRequestError(
            f"{name} could not be decoded as audio (truncated, or not an audio file): {detail}",
            param="file",
            code="invalid_audio",
        )
    usable = len(done.stdout) - len(done.stdout) % 4
    return np.frombuffer(done.stdout[:usable], dtype="<f4").astype(np.float32)
