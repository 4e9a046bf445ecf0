"""The streaming side of a reasoning format: one splitter per choice tells thought from answer as text arrives."""

from __future__ import annotations

from abc import ABC, abstractmethod


class ReasoningSplitter(ABC):
    """Splits one choice's text, fed as it streams, into (reasoning delta, content delta) pairs.

    Whatever the cut of the text into pieces, the deltas concatenated are the same: a piece that may be the start of
    a marker is held back until the next piece (or `finish`) tells. Markers never reach either side.
    """

    def __init__(self, thinking: bool) -> None:
        self._tokens = 0
        self._undecided_tokens = 0  # tokens of held text that may yet open the thought
        self._had_thought = thinking

    def feed(self, text: str, token_count: int) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next `token_count` tokens) releases."""
        was_thinking, had_thought = self.thinking, self._had_thought
        reasoning, content = self._split(text)  # sets `_had_thought` when a thought opens in it
        if was_thinking or self.thinking or self._had_thought != had_thought:
            self._tokens += self._undecided_tokens + token_count
            self._undecided_tokens = 0
            self._had_thought = True
        elif self._undecided():
            self._undecided_tokens += token_count
        else:
            self._undecided_tokens = 0
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever was held back (a partial marker at the end is text after all)."""
        return self._flush()

    @property
    def reasoning_tokens(self) -> int:
        """Tokens generated inside the thought, its markers included."""
        return self._tokens

    @property
    def had_thought(self) -> bool:
        """Whether the text held a thought at all (the message's reasoning is None otherwise)."""
        return self._had_thought

    @property
    @abstractmethod
    def thinking(self) -> bool:
        """Whether the text so far is still inside the thought."""

    @abstractmethod
    def _split(self, text: str) -> tuple[str, str]: ...

    @abstractmethod
    def _flush(self) -> tuple[str, str]: ...

    def _undecided(self) -> bool:
        """Whether held text may yet open the thought (its tokens are counted once it does)."""
        return False


def split_whole(splitter: ReasoningSplitter, text: str) -> tuple[str | None, str]:
    """A whole text through a fresh splitter: (reasoning, or None without a thought; content)."""
    reasoning, content = splitter.feed(text, 0)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.had_thought else None), content + more_content
