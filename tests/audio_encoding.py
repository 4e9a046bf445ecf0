"""Test audio in the containers clients send, encoded with PyAV's own codecs (no system ffmpeg), and decode bombs."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
import soundfile

from transformers_openai.serving.speech.audio import decode_audio

RATE = 16000


def encoded(clip: bytes, container: str, codec: str, rate: int = RATE) -> bytes:
    """`clip` (any format the server reads) re-encoded as `codec` in `container` at `rate`."""
    samples = decode_audio(clip, rate, 60)
    layout = "stereo" if codec == "vorbis" else "mono"  # FFmpeg's own vorbis encoder takes two channels only
    channels = np.repeat(samples.reshape(1, -1), 2 if layout == "stereo" else 1, axis=0)
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as target:
        stream = target.add_stream(codec, rate=rate, layout=layout)
        assert isinstance(stream, av.AudioStream)
        stream.codec_context.options = {"strict": "experimental"}  # FFmpeg's own vorbis encoder is experimental
        size = stream.codec_context.frame_size or 1024  # most encoders take frames of exactly their size
        for start in range(0, channels.shape[1], size):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(channels[:, start : start + size]), format="fltp", layout=layout
            )
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                target.mux(packet)
        for packet in stream.encode(None):
            target.mux(packet)
    return out.getvalue()


def low_rate_wav(rate: int = 1, size: int = 40_000) -> bytes:
    """A `size`-byte 16-bit WAV sampled at `rate` Hz: 20,000 s of audio at 1 Hz, 1.3 GB once resampled to 16 kHz."""
    out = io.BytesIO()
    with wave.open(out, "wb") as target:
        target.setnchannels(1)
        target.setsampwidth(2)
        target.setframerate(rate)
        target.writeframes(np.zeros((size - 44) // 2, dtype="<i2").tobytes())
    return out.getvalue()


def low_rate_matroska(rate: int = 2, samples: int = 500_000, frames: int = 1) -> bytes:
    """Matroska holding `frames` PCM frames of `samples` each at `rate` Hz (about 1 MB by default): one frame of it
    resampled to 16 kHz would be 4 billion samples."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as target:
        stream = target.add_stream("pcm_s16le", rate=rate, layout="mono")
        for index in range(frames):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, samples), dtype=np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, index * samples
            for packet in stream.encode(frame):
                target.mux(packet)
        for packet in stream.encode(None):
            target.mux(packet)
    return out.getvalue()


def silent_flac(seconds: float, rate: int = 8000) -> bytes:
    """FLAC of `seconds` of silence, written a block at a time (two hours of it take 180 KB)."""
    out = io.BytesIO()
    block = np.zeros(1 << 20, dtype=np.int16)
    left = int(seconds * rate)
    with soundfile.SoundFile(out, "w", samplerate=rate, channels=1, format="FLAC", subtype="PCM_16") as target:
        while left > 0:
            target.write(block[: min(left, block.size)])
            left -= block.size
    return out.getvalue()
