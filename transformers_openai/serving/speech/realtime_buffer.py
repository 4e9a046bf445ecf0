"""A realtime session's input audio buffer: base64 chunks in the session's format in, int16 samples held, a turn's
audio out as a WAV file for the transcription path (which resamples it to the model's rate as it does uploads)."""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from transformers_openai.protocol.realtime import SAMPLE_RATES, AudioFormat
from transformers_openai.serving.errors import BadRequestError

_G711_SUBTYPES = {"g711_ulaw": "ULAW", "g711_alaw": "ALAW"}


def decode_chunk(audio: str, audio_format: AudioFormat) -> np.ndarray:
    """One `input_audio_buffer.append`'s audio as int16 samples."""
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("audio is not valid base64", param="audio", code="invalid_audio") from None
    if audio_format == "pcm16":
        if len(raw) % 2:
            raise BadRequestError(
                "pcm16 audio must be whole 16-bit samples (an even number of bytes)",
                param="audio",
                code="invalid_audio",
            )
        return np.frombuffer(raw, dtype="<i2").astype(np.int16)
    if not raw:
        return np.zeros(0, dtype=np.int16)
    import soundfile  # where used, as audio.py does: importing the app must not need the audio libraries

    samples, _ = soundfile.read(
        io.BytesIO(raw),
        format="RAW",
        subtype=_G711_SUBTYPES[audio_format],
        samplerate=SAMPLE_RATES[audio_format],
        channels=1,
        dtype="int16",
    )
    return np.asarray(samples, dtype=np.int16)


def wav_bytes(samples: np.ndarray, sampling_rate: int) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, sampling_rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


class AudioBuffer:
    """The samples not yet committed, at absolute positions from the start of the session's audio."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.start = 0  # position of the first sample held
        self.size = 0

    @property
    def end(self) -> int:
        return self.start + self.size

    def append(self, samples: np.ndarray) -> None:
        if samples.size:
            self._chunks.append(samples)
            self.size += samples.size

    def take(self, until: int) -> np.ndarray:
        """The samples before `until`, removed from the buffer."""
        data = self._joined()
        cut = max(0, min(until - self.start, data.size))
        taken, rest = data[:cut], data[cut:]
        self._chunks = [rest] if rest.size else []
        self.start += cut
        self.size = rest.size
        return taken

    def drop_before(self, position: int) -> None:
        """Forgets the samples before `position` (silence before any speech, past the padding kept)."""
        if position > self.start:
            self.take(position)

    def clear(self) -> None:
        self.take(self.end)

    def _joined(self) -> np.ndarray:
        if len(self._chunks) == 1:
            return self._chunks[0]
        joined = np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.int16)
        self._chunks = [joined] if joined.size else []
        return joined
