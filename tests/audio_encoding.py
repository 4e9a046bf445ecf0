"""Test audio in the containers clients send, encoded with PyAV's own codecs (no system ffmpeg)."""

from __future__ import annotations

import io

import av
import numpy as np

from transformers_openai.serving.audio import decode_audio

RATE = 16000


def encoded(clip: bytes, container: str, codec: str, rate: int = RATE) -> bytes:
    """`clip` (any format the server reads) re-encoded as `codec` in `container` at `rate`."""
    samples = decode_audio(clip, rate, 60)
    layout = "stereo" if codec == "vorbis" else "mono"  # FFmpeg's own vorbis encoder takes two channels only
    channels = np.repeat(samples.reshape(1, -1), 2 if layout == "stereo" else 1, axis=0)
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as target:
        stream = target.add_stream(codec, rate=rate, layout=layout)
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
