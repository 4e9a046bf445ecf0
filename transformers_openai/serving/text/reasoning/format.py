"""What a reasoning format offers the handlers (chat, Responses, the grammar after the thought)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from transformers_openai.serving.text.reasoning.splitter import ReasoningSplitter


class ReasoningFormat(Protocol):
    """How a model writes its thought before its answer."""

    @property
    def start(self) -> str:
        """The marker that opens the thought, e.g. "<think>"."""
        ...

    @property
    def end(self) -> str:
        """The marker that closes it, e.g. "</think>"."""
        ...

    @property
    def name(self) -> str:
        """The --reasoning-parser it came from: qwen3, deepseek_r1, response_schema."""
        ...

    @property
    def keeps_markers(self) -> bool:
        """The markers are special tokens: decoding must keep special tokens for them to be seen."""
        ...

    def thinks_at_start(self, prompt_ids: Sequence[int]) -> bool:
        """Whether generation starts inside the thought: the rendered prompt ends in an unclosed start marker (or,
        for a format whose model may omit it, does not end in a closed thought); False when thinking is off."""
        ...

    def splitter(self, thinking: bool) -> ReasoningSplitter:
        """A streaming splitter for one choice; `thinking`: what `thinks_at_start` said of its prompt."""
        ...

    def split(self, text: str, thinking: bool) -> tuple[str | None, str]:
        """A whole text: (the thought, None when there was none; the answer)."""
        ...
