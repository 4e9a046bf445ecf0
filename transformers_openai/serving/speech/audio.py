"""Audio files in, mono float samples at the model's rate out: libsndfile, PyAV for the rest.

A file is refused from its header where the header tells enough (its rate, its length), and is otherwise decoded
block by block against a running count of the samples it will become, so that no upload costs much more memory
than the length limit's worth of samples, whatever its size or rate.
"""

from __future__ import annotations

import io
import logging
import math
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from transformers_openai.serving.errors import BadRequestError

if TYPE_CHECKING:
    import soundfile

logger = logging.getLogger(__name__)

# Below 4 kHz a file holds no band of speech worth transcribing (telephone audio is 8 kHz), and each of its samples
# becomes more than four at the model's 16 kHz: left unchecked, a 40 KB WAV at 1 Hz resamples to 1.3 GB.
MIN_SAMPLE_RATE = 4000
# Samples decoded at once over all channels (4 MiB of float32): what a block costs before it is mixed and resampled;
# large enough that an mp3 is read in few calls (libmpg123 complains at the seams between calls, losing nothing).
BLOCK_SAMPLES = 1 << 20
# A header's length may be a little off (codec padding, AAC's priming): only a length past the limit by more than
# this is refused before decoding; the running count refuses the rest.
HEADER_SLACK_S = 1.0
# What libsndfile reports as the frames of a stream whose header does not give its length.
_UNKNOWN_FRAMES = 1 << 62


class _Budget:
    """The samples a request may decode into, and the errors that say why a file is refused."""

    def __init__(self, name: str, sampling_rate: int, max_seconds: float) -> None:
        self.name = name
        self.rate = sampling_rate
        self.max_seconds = max_seconds
        self.max_samples = max_seconds * sampling_rate

    def check_rate(self, rate: float) -> None:
        if rate < MIN_SAMPLE_RATE:
            raise BadRequestError(
                f"{self.name} has a sample rate of {rate:g} Hz; this server takes audio sampled at "
                f"{MIN_SAMPLE_RATE} Hz or more",
                param="file",
                code="invalid_audio",
            )

    def check_length(self, seconds: float, slack: float = 0.0) -> None:
        """Refuses a file whose length, as its header gives it, is over the limit."""
        if seconds > self.max_seconds + slack:
            raise BadRequestError(
                f"{self.name} is {seconds:.1f} s long; this server takes at most {self.max_seconds:g} s of audio per "
                "request",
                param="file",
                code="audio_too_long",
            )

    def admit(self, output_samples: float) -> None:
        """Refuses a file once what it has decoded so far would be more samples than the limit, before they are
        resampled: called with the running count of samples at the model's rate."""
        if output_samples > self.max_samples:
            raise BadRequestError(
                f"{self.name} is longer than {self.max_seconds:g} s; this server takes at most {self.max_seconds:g} s "
                "of audio per request",
                param="file",
                code="audio_too_long",
            )

    def check_finite(self, samples: np.ndarray) -> None:
        if not np.isfinite(samples).all():
            raise BadRequestError(
                f"{self.name} holds samples that are not finite numbers", param="file", code="invalid_audio"
            )


def decode_audio(data: bytes | BinaryIO, sampling_rate: int, max_seconds: float, filename: str = "") -> np.ndarray:
    """Decodes an uploaded file (wav, flac, mp3, ogg/opus, webm, m4a, ...) to mono float32 at `sampling_rate`.

    `data` is the file's bytes or a seekable binary file (an upload spooled to disk is read from there, not copied).
    Blocking: call it in a worker thread. Raises `BadRequestError` (param `file`) for an empty, truncated,
    silent-length or undecodable file, for a sample rate under `MIN_SAMPLE_RATE` and for audio longer than
    `max_seconds` (refused from the header where it gives the length, otherwise once decoding passes the limit).
    """
    name = f"'{filename}'" if filename else "the file"
    source: BinaryIO = io.BytesIO(data) if isinstance(data, bytes) else data
    source.seek(0, io.SEEK_END)
    if source.tell() == 0:
        raise BadRequestError(f"{name} is empty: upload an audio file", param="file", code="invalid_audio")
    source.seek(0)
    budget = _Budget(name, sampling_rate, max_seconds)
    samples = _with_libsndfile(source, budget)
    if samples is None:
        source.seek(0)
        samples = _with_pyav(source, budget)
    if samples.size == 0:
        raise BadRequestError(f"{name} holds no audio samples", param="file", code="invalid_audio")
    budget.check_length(samples.size / sampling_rate)
    return samples


def warm_up_decoder(sampling_rate: int) -> None:
    """Decodes a short generated clip once, resampling it, so that the first upload does not pay for loading the
    decoders and the resampler."""
    import soundfile

    rate = 22050 if sampling_rate != 22050 else 44100
    clip = io.BytesIO()
    soundfile.write(clip, np.sin(np.linspace(0, 440 * 2 * np.pi, rate)).astype(np.float32), rate, format="WAV")
    decode_audio(clip.getvalue(), sampling_rate, max_seconds=60.0)


def _with_libsndfile(source: BinaryIO, budget: _Budget) -> np.ndarray | None:
    """wav, flac, ogg/vorbis/opus and mp3 through libsndfile; None for what it cannot read."""
    import soundfile

    try:
        sound = soundfile.SoundFile(source)
    except (soundfile.LibsndfileError, RuntimeError, ValueError, EOFError, TypeError):
        return None
    with sound:
        budget.check_rate(sound.samplerate)
        if 0 < sound.frames < _UNKNOWN_FRAMES:
            budget.check_length(math.ceil(sound.frames * budget.rate / sound.samplerate) / budget.rate)
        try:
            return _read_blocks(sound, budget)
        except (soundfile.LibsndfileError, RuntimeError, ValueError, EOFError, TypeError):
            return None  # e.g. an mp3 libsndfile gives up on halfway: PyAV tries it whole


def _read_blocks(sound: soundfile.SoundFile, budget: _Budget) -> np.ndarray:
    """Reads the file a block at a time, mixes each to mono and resamples it with a streaming soxr resampler: the
    same samples as librosa's `load` (soxr at its high quality) gives for the whole file at once."""
    import soxr

    rate = int(sound.samplerate)
    resampler = None if rate == budget.rate else soxr.ResampleStream(rate, budget.rate, 1, "float32", "HQ")
    frames = max(1, BLOCK_SAMPLES // max(1, sound.channels))
    chunks: list[np.ndarray] = []
    taken = 0
    while True:
        block = sound.read(frames, dtype="float32", always_2d=True)
        if block.shape[0] == 0:
            break
        taken += block.shape[0]
        budget.admit(taken * budget.rate / rate)
        mono = block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]
        budget.check_finite(mono)
        chunks.append(np.ascontiguousarray(mono) if resampler is None else resampler.resample_chunk(mono))
    if resampler is None:
        return _joined(chunks)
    chunks.append(resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
    samples = _joined(chunks)
    expected = math.ceil(taken * budget.rate / rate)  # the length librosa's resample gives: cut or padded to it
    if samples.size >= expected:
        return samples[:expected]
    return np.concatenate([samples, np.zeros(expected - samples.size, dtype=np.float32)])


def _with_pyav(source: BinaryIO, budget: _Budget) -> np.ndarray:
    """Every other container (webm, m4a/mp4, ...) through PyAV, whose wheels carry FFmpeg's codecs: no system
    ffmpeg. Refused from the stream's rate and the container's length where known, then frame by frame."""
    import av

    name = budget.name
    chunks: list[np.ndarray] = []
    expected = 0.0
    try:
        with av.open(source, mode="r") as container:
            if not container.streams.audio:
                raise BadRequestError(f"{name} has no audio track", param="file", code="invalid_audio")
            stream = container.streams.audio[0]
            if stream.rate:
                budget.check_rate(stream.rate)
            seconds = _stated_seconds(container, stream)
            if seconds is not None:
                budget.check_length(seconds, slack=HEADER_SLACK_S)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=budget.rate)
            for frame in container.decode(stream):
                if not isinstance(frame, av.AudioFrame) or frame.samples == 0:
                    continue
                budget.check_rate(frame.sample_rate)  # a frame may change the rate the header gave
                expected += frame.samples * budget.rate / frame.sample_rate
                budget.admit(expected)
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    budget.check_finite(chunks[-1])
            chunks.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    except (av.FFmpegError, ValueError, EOFError) as exc:
        logger.info("could not decode %s: %s", name, exc)
        raise BadRequestError(
            f"{name} could not be decoded as audio (truncated, or not an audio file): {exc}",
            param="file",
            code="invalid_audio",
        ) from exc
    return _joined(chunks)


def _stated_seconds(container: object, stream: object) -> float | None:
    """The audio's length as the container states it before anything is decoded; None where it does not."""
    import av

    duration, time_base = getattr(stream, "duration", None), getattr(stream, "time_base", None)
    if duration and time_base:
        return float(duration * time_base)
    total = getattr(container, "duration", None)  # in FFmpeg's microseconds
    return float(total) / av.time_base if total else None


def _joined(chunks: list[np.ndarray]) -> np.ndarray:
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)
