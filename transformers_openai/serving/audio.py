"""Audio bytes in, mono float samples at the model's rate out: librosa (libsndfile), PyAV for the rest."""

from __future__ import annotations

import io
import logging

import numpy as np

from transformers_openai.serving.errors import BadRequestError

logger = logging.getLogger(__name__)


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
        samples = _with_pyav(data, sampling_rate, max_seconds, name)
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


def _with_pyav(data: bytes, sampling_rate: int, max_seconds: float, name: str) -> np.ndarray:
    """Every other container (webm, m4a/mp4, ...) through PyAV, whose wheels carry FFmpeg's codecs: no system
    ffmpeg. Decoding stops once the audio is longer than `max_seconds`, so a long file costs no more than that."""
    import av

    limit = int(max_seconds * sampling_rate)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise BadRequestError(f"{name} has no audio track", param="file", code="invalid_audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            for frame in container.decode(stream):
                if not isinstance(frame, av.AudioFrame):
                    continue
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if total > limit:
                    raise BadRequestError(
                        f"{name} is longer than {max_seconds:g} s; this server takes at most {max_seconds:g} s of "
                        "audio per request",
                        param="file",
                        code="audio_too_long",
                    )
            chunks.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    except (av.FFmpegError, ValueError, EOFError) as exc:
        logger.info("could not decode %s: %s", name, exc)
        raise BadRequestError(
            f"{name} could not be decoded as audio (truncated, or not an audio file): {exc}",
            param="file",
            code="invalid_audio",
        ) from exc
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, dtype=np.float32)
