"""Server-side voice activity detection for realtime sessions: an energy detector on 10 ms frames.

A frame is speech when its loudness passes a level set by the session's `threshold` (0.5: -40 dBFS, the middle of
the range from -55 dBFS, near-silent room noise, to -25 dBFS, close speech). Speech starts after a few loud frames in
a row (a click is not speech) and stops after `silence_duration_ms` of quiet frames. It needs no model and costs a
few microseconds per chunk, so it runs on the event loop as audio arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

FRAME_MS = 10
MIN_SPEECH_FRAMES = 3
QUIETEST_DBFS = -55.0
LOUDEST_DBFS = -25.0
_FULL_SCALE = 32768.0


@dataclass(frozen=True)
class VoiceEvent:
    kind: Literal["start", "stop"]
    position: int  # in samples from the start of the session's audio: where speech started, or where it ended
    cut: int  # where the turn's audio starts (its start less the padding) or ends (the stop was told)


class VoiceActivity:
    """Feeds on a session's samples as they come; says where speech starts and stops."""

    def __init__(
        self, sampling_rate: int, threshold: float, silence_duration_ms: int, prefix_padding_ms: int, origin: int = 0
    ) -> None:
        """`origin`: the position of the first sample it will be fed."""
        self._frame = sampling_rate * FRAME_MS // 1000
        self._padding = sampling_rate * prefix_padding_ms // 1000
        level_db = QUIETEST_DBFS + threshold * (LOUDEST_DBFS - QUIETEST_DBFS)
        # Compared against each frame's mean square, in int16 units, so no logarithm per frame.
        self._level = (10 ** (level_db / 20) * _FULL_SCALE) ** 2
        self._silence_frames = max(1, silence_duration_ms // FRAME_MS)
        self._pending = np.zeros(0, dtype=np.int16)  # the samples of a frame not yet complete
        self._position = origin  # of the first pending sample
        self.speaking = False
        self._loud_run = 0
        self._quiet_run = 0
        self._last_loud_end = origin

    def feed(self, samples: np.ndarray) -> list[VoiceEvent]:
        """The starts and stops these samples (int16) bring, in order."""
        data = np.concatenate([self._pending, samples]) if self._pending.size else samples
        whole = data.size // self._frame * self._frame
        frames = data[:whole].astype(np.float32).reshape(-1, self._frame)
        loud = (frames * frames).mean(axis=1) > self._level
        events = [event for index, is_loud in enumerate(loud.tolist()) if (event := self._step(index, is_loud))]
        self._position += whole
        self._pending = data[whole:].copy()
        return events

    def _step(self, index: int, loud: bool) -> VoiceEvent | None:
        end = self._position + (index + 1) * self._frame
        if loud:
            self._loud_run += 1
            self._quiet_run = 0
            self._last_loud_end = end
            if not self.speaking and self._loud_run >= MIN_SPEECH_FRAMES:
                self.speaking = True
                start = end - self._loud_run * self._frame
                return VoiceEvent("start", start, max(0, start - self._padding))
            return None
        self._loud_run = 0
        if not self.speaking:
            return None
        self._quiet_run += 1
        if self._quiet_run >= self._silence_frames:
            self.speaking = False
            self._quiet_run = 0
            return VoiceEvent("stop", self._last_loud_end, end)
        return None

    @property
    def position(self) -> int:
        """Samples seen so far in whole frames: where the audio fed has been judged up to."""
        return self._position
