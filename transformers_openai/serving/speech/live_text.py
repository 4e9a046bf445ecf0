"""The text of a window being decoded that the transcript will keep whatever the window's next tokens are.

A streamed transcription sends text as its tokens come only where no later token can take it back. With fallback
off (one temperature), a window's text is dropped only by OpenAI's seek and silence rules (longform.split_window):

- the window's first segment (its text up to the first pair of timestamps) is always kept: a pair closes it, and
  without a pair the whole window is one segment; it streams token by token;
- a later segment is kept only once it closes (text, then a timestamp): a window that ends inside one drops it
  and starts the next window where it began; its text is held until its closing timestamp;
- a segment that starts at or past the end of the audio is dropped, and so is the whole window when its first
  step finds likely silence (the rest of the test is known only at its end): their text is held.

Held text is not lost: the handler sends what the window's finished segments add to what was sent.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from transformers_openai.engine.detokenizer import Decoder, IncrementalDetokenizer
from transformers_openai.serving.speech.longform import NO_SPEECH_THRESHOLD, SECONDS_PER_TIMESTAMP

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowPlace:
    """Where a window sits in its audio."""

    start: float  # seconds into the audio
    duration: float  # of the whole audio, seconds


class WindowText:
    """Feeds on one decoding of one window, token by token; `push` returns the text it can vouch for now."""

    def __init__(self, decoder: Decoder, eot: int, timestamp_begin: int, place: WindowPlace) -> None:
        self._decoder = decoder
        self._eot = eot
        self._begin = timestamp_begin
        self._place = place
        self._after_pair = False  # a pair of timestamps has closed the first segment
        self._previous_timestamp = False
        self._live: IncrementalDetokenizer | None = None  # the first segment, while its text streams
        self._held: list[int] = []  # a later segment's text tokens, until it closes
        self._held_start = 0.0
        self._silence_possible = False
        self._started = False
        self._opened = False

    def push(self, token_ids: list[int], no_speech_prob: float = 0.0) -> str:
        """Takes the tokens of one engine output (the first one brings the window's no-speech probability)."""
        if not self._started:
            self._started = True
            self._silence_possible = no_speech_prob > NO_SPEECH_THRESHOLD
        return "".join(self._one(token) for token in token_ids)

    def _one(self, token: int) -> str:
        if token >= self._begin:
            return self._timestamp(token)
        self._previous_timestamp = False
        if token == self._eot:  # the end: a later segment still open is dropped
            return self._close_live()
        if token > self._eot:  # another special token (the rules suppress them): no text
            return ""
        if self._live is not None:
            return self._live.push(token)
        self._held.append(token)
        return ""

    def _timestamp(self, token: int) -> str:
        seconds = self._place.start + round((token - self._begin) * SECONDS_PER_TIMESTAMP, 2)
        if self._previous_timestamp:  # a pair: what follows is a later segment
            self._after_pair = True
            sent = self._close_live()
        elif self._held:  # text, then a timestamp: the held segment closed
            sent = self._close_held(seconds)
        else:
            sent = self._close_live()
        if not self._opened:  # the window's first token (always a timestamp) opens its first segment
            self._opened = True
            if self._may_stream(seconds):
                self._live = IncrementalDetokenizer(self._decoder, skip_special_tokens=False)
        self._previous_timestamp = True
        self._held_start = seconds
        return sent

    def _may_stream(self, start: float) -> bool:
        return not self._silence_possible and start < self._place.duration

    def _close_live(self) -> str:
        live, self._live = self._live, None
        if live is None:
            self._held.clear()
            return ""
        return live.flush()

    def _close_held(self, end: float) -> str:
        tokens, self._held = self._held, []
        start = self._held_start
        if not self._after_pair or end <= start or not self._may_stream(start):
            return ""  # the first segment held back, or one the transcript drops: the finished segments tell
        return self._decoder.decode(tokens, skip_special_tokens=False)


class SentText:
    """The text a stream has sent, always a prefix of the transcript's final text (which is stripped: the first
    delta starts at the first word, and a trailing space waits for the word after it)."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._raw = ""  # the finished segments' text, and any live text past it
        self._final = ""  # the finished segments' text
        self._sent = ""

    def add_live(self, piece: str) -> str:
        """Text a window in decoding vouched for; returns the delta to send."""
        self._raw += piece
        return self._delta()

    def add_segment(self, text: str) -> str:
        """A finished segment's text; returns what it adds to the text sent."""
        self._final += text
        if not self._raw.startswith(self._final):
            if not self._final.startswith(self._raw):
                logger.warning(
                    "transcription %s streamed text its transcript does not have: %r",
                    self._request_id,
                    self._raw[len(os.path.commonprefix([self._raw, self._final])) :],
                    extra={"request_id": self._request_id},
                )
            self._raw = self._final
        return self._delta()

    def _delta(self) -> str:
        full = self._raw.strip()
        if len(full) <= len(self._sent) or not full.startswith(self._sent):
            return ""
        delta, self._sent = full[len(self._sent) :], full
        return delta
