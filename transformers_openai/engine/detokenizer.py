"""Incremental detokenization that never splits a multi-byte character and never drops a space."""

from __future__ import annotations

from typing import Protocol

# Enough context for byte-level BPE and SentencePiece to decide spacing and merge partial characters.
_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a small window ending at the newest token and emits only what that window adds to
    the text already emitted. A delta that ends in U+FFFD is held back until the character completes.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True, context: list[int] | None = None):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context[-_CONTEXT_TOKENS:]) if context else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Adds one token and returns the text that became final with it (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > _CONTEXT_TOKENS * 4:
            self._compact()
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete character, if any)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _compact(self) -> None:
        # Drop tokens no window will look at again, keeping memory per request constant.
        drop = self._prefix_offset
        self._ids = self._ids[drop:]
        self._prefix_offset -= drop
        self._read_offset -= drop
