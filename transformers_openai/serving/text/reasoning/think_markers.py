"""Thoughts between two plain markers, `<think>` and `</think>` (Qwen3, DeepSeek-R1 and their distills, SmolLM3)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers_openai.serving.text.reasoning.splitter import ReasoningSplitter, split_whole

# Prompt tokens decoded to find the markers when they are not single tokens: a generation prompt's ending is short,
# so the window starts small and doubles while it shows no marker (a long thought being continued), up to a bound.
PROMPT_TAIL_TOKENS = 64
MAX_PROMPT_TAIL_TOKENS = 4096


class _Phase(enum.Enum):
    BEFORE = "before"  # not thinking: the answer's first characters may still open a thought
    OPENING = "opening"  # thinking from the start: a start marker the model writes anyway is dropped
    THINKING = "thinking"
    ANSWER = "answer"


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the start of `marker` (held back: the marker may follow)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class MarkerSplitter(ReasoningSplitter):
    """One thought at the start of the text, between `start` and `end`.

    Only a start marker at the very start (after whitespace, which goes with it) opens a thought; after the thought,
    markers are the answer's text. Without an end marker, the whole text is the thought.
    """

    def __init__(self, start: str, end: str, thinking: bool) -> None:
        super().__init__(thinking)
        self._start, self._end = start, end
        self._phase = _Phase.OPENING if thinking else _Phase.BEFORE
        self._held = ""

    @property
    def thinking(self) -> bool:
        return self._phase in (_Phase.OPENING, _Phase.THINKING)

    def _undecided(self) -> bool:
        return self._phase is _Phase.BEFORE and bool(self._held)

    def _split(self, text: str) -> tuple[str, str]:
        if self._phase is _Phase.ANSWER:
            return "", text
        held, reasoning, content = self._held + text, "", ""
        while True:
            if self._phase in (_Phase.BEFORE, _Phase.OPENING):
                body = held.lstrip()
                if body.startswith(self._start):
                    held, self._phase, self._had_thought = body[len(self._start) :], _Phase.THINKING, True
                    continue
                if self._start.startswith(body):  # nothing but whitespace, or a marker's beginning: wait
                    break
                if self._phase is _Phase.BEFORE:
                    content, held, self._phase = held, "", _Phase.ANSWER
                    break
                self._phase = _Phase.THINKING
            if self._phase is _Phase.THINKING:
                at = held.find(self._end)
                if at >= 0:
                    reasoning += held[:at]
                    content, held, self._phase = held[at + len(self._end) :], "", _Phase.ANSWER
                    break
                keep = partial_marker(held, self._end)
                reasoning += held[: len(held) - keep]
                held = held[len(held) - keep :]
            break
        self._held = held
        return reasoning, content

    def _flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


@dataclass(frozen=True)
class ThinkMarkers:
    """A reasoning format of two markers.

    `implicit_start` (deepseek_r1): the model may think without writing the start marker (DeepSeek-R1 did not), so
    the text is a thought from its start unless the prompt closed one; otherwise (qwen3) a thought is one the prompt
    opened or the text opens. `marker_ids`: the markers' token ids where each is one added token (then they are
    found in the prompt by id); `keeps_markers`: they are special tokens, which decoding must keep to be seen.
    `decode` turns the prompt's last tokens into text, where the markers are not single tokens.
    """

    decode: Callable[[list[int]], str]
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False
    marker_ids: tuple[int, int] | None = None
    keeps_markers: bool = False
    name: str = "qwen3"

    def thinks_at_start(self, prompt_ids: Sequence[int]) -> bool:
        if self.marker_ids is not None:
            opened = _last(prompt_ids, self.marker_ids[0]) > _last(prompt_ids, self.marker_ids[1])
        else:
            opened = self._opened_in_text(prompt_ids)
        if opened or not self.implicit_start:
            return opened
        # A prompt that ends in a closed thought (a template's empty one, thinking off) starts in the answer.
        return not self.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])).rstrip().endswith(self.end)

    def _opened_in_text(self, prompt_ids: Sequence[int]) -> bool:
        size = PROMPT_TAIL_TOKENS
        while True:
            tail = self.decode(list(prompt_ids[-size:]))
            start, end = tail.rfind(self.start), tail.rfind(self.end)
            if start >= 0 or end >= 0 or size >= min(len(prompt_ids), MAX_PROMPT_TAIL_TOKENS):
                return start > end
            size *= 2

    def splitter(self, thinking: bool) -> ReasoningSplitter:
        return MarkerSplitter(self.start, self.end, thinking)

    def split(self, text: str, thinking: bool) -> tuple[str | None, str]:
        return split_whole(self.splitter(thinking), text)


def _last(ids: Sequence[int], token_id: int) -> int:
    """The index of the last `token_id` in `ids`, -1 when there is none (searched in C: prompts can be long)."""
    try:
        return len(ids) - 1 - list(reversed(ids)).index(token_id)
    except ValueError:
        return -1
