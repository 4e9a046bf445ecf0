"""OpenAI whisper's long-form rules, without a model: a window's scores, its segments and where the next one starts."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

FRAMES_PER_SECOND = 100  # mel frames: 10 ms each
WINDOW_FRAMES = 3000  # 30 s
FRAMES_PER_POSITION = 2  # one timestamp step (0.02 s) is two mel frames
SECONDS_PER_TIMESTAMP = 0.02

# Fallback and no-speech thresholds, as OpenAI's transcribe() sets them.
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
FALLBACK_STEP = 0.2
# A window decoded hotter than this does not pass its text on as the next window's prompt.
PROMPT_RESET_TEMPERATURE = 0.5


@dataclass(frozen=True)
class Attempt:
    """One decoding of a window at one temperature."""

    tokens: list[int]  # sampled, end of text excluded
    logprob_sum: float  # of every sampled token, end of text included
    temperature: float
    no_speech_prob: float
    text: str  # the text tokens decoded

    @property
    def avg_logprob(self) -> float:
        return self.logprob_sum / (len(self.tokens) + 1)

    @property
    def compression_ratio(self) -> float:
        return compression_ratio(self.text)

    @property
    def is_silence(self) -> bool:
        """Likely no speech: its text is dropped and the window skipped."""
        return self.no_speech_prob > NO_SPEECH_THRESHOLD and self.avg_logprob < LOGPROB_THRESHOLD

    @property
    def needs_fallback(self) -> bool:
        """Repetitive or unlikely text: worth a retry at a higher temperature (never for a likely silence)."""
        if self.no_speech_prob > NO_SPEECH_THRESHOLD:
            return False
        return self.compression_ratio > COMPRESSION_RATIO_THRESHOLD or self.avg_logprob < LOGPROB_THRESHOLD


def compression_ratio(text: str) -> float:
    """UTF-8 bytes of the text over its zlib-compressed bytes: high for repetition loops."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def temperatures(start: float) -> list[float]:
    """The temperatures to try in turn: `start`, then up in steps of 0.2 to 1.0."""
    steps = [start]
    while steps[-1] + FALLBACK_STEP <= 1.0 + 1e-9:
        steps.append(round(steps[-1] + FALLBACK_STEP, 2))
    return steps


@dataclass
class SegmentTokens:
    """A segment as the window's tokens give it: times relative to the window, its tokens with their timestamps."""

    start: float
    end: float
    tokens: list[int]
    text_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WindowSplit:
    segments: list[SegmentTokens]
    advance: int  # mel frames to move the seek by


def split_window(tokens: list[int], eot: int, timestamp_begin: int, window_frames: int) -> WindowSplit:
    """Segments of one window's tokens, and how far the next window starts (OpenAI's seek rule).

    Each pair of adjacent timestamps closes a segment. A window ending on a single timestamp is consumed whole;
    otherwise its unfinished last segment is dropped and the next window starts at the last closing timestamp.
    Without any pair, the window is one segment (up to its last timestamp if it has one) and is consumed whole.

    Args:
        tokens: the sampled tokens, end of text excluded.
        eot: the end-of-text id; text tokens are those below it.
        timestamp_begin: the id of `<|0.00|>`.
        window_frames: the mel frames of real audio in this window (at most 3000).
    """
    is_ts = [token >= timestamp_begin for token in tokens]
    single_ending = len(tokens) >= 2 and not is_ts[-2] and is_ts[-1] or (len(tokens) == 1 and is_ts[0])
    closing = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    segments: list[SegmentTokens] = []
    if closing:
        cuts = closing + [len(tokens)] if single_ending else closing
        last = 0
        for cut in cuts:
            part = tokens[last:cut]
            start = (part[0] - timestamp_begin) * SECONDS_PER_TIMESTAMP
            end = (part[-1] - timestamp_begin) * SECONDS_PER_TIMESTAMP
            segments.append(_segment(start, end, part, eot))
            last = cut
        advance = window_frames if single_ending else (tokens[last - 1] - timestamp_begin) * FRAMES_PER_POSITION
    else:
        duration = window_frames / FRAMES_PER_SECOND
        stamps = [token for token in tokens if token >= timestamp_begin]
        if stamps and stamps[-1] != timestamp_begin:
            duration = (stamps[-1] - timestamp_begin) * SECONDS_PER_TIMESTAMP
        segments.append(_segment(0.0, duration, tokens, eot))
        advance = window_frames
    kept = [s for s in segments if s.end > s.start and s.text_tokens]
    # A window always moves on: a seek that stays put would decode the same audio forever.
    return WindowSplit(kept, advance if advance > 0 else window_frames)


def _segment(start: float, end: float, tokens: list[int], eot: int) -> SegmentTokens:
    text = [token for token in tokens if token < eot]
    return SegmentTokens(round(start, 2), round(end, 2), list(tokens), text)
