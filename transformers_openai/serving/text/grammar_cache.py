"""The compiled grammars of distinct schemas, kept between requests within a byte budget, least recently used first out.

An entry's size is an estimate, not a reading: llguidance reports no memory figure for a compiled grammar, so the
heap that compiling takes was measured (glibc's `mallinfo2` before and after compiling N distinct object schemas of
1 to 140 KiB of grammar, SmolLM2's vocabulary): about 76-78 bytes per byte of serialized grammar over 8 KiB, and
50-190 KiB for the smallest ones; with the first mask and its tensors, about 76 bytes per byte plus 160 KiB.
`estimate_bytes` takes 80 bytes per grammar byte plus 256 KiB, above every reading (a unit test checks it): a
64 KiB schema counts about 5.4 MiB, a 1 KiB one 340 KiB. The lexer states that requests add to an entry as they
use it (100-450 KiB measured over a walk of 30 tokens) are bounded by llguidance's `max_lexer_states` limit rather
than counted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

BYTES_PER_GRAMMAR_BYTE = 80
ENTRY_OVERHEAD_BYTES = 256 * 1024


def estimate_bytes(grammar: str) -> int:
    """What a grammar compiled by llguidance keeps in memory, by the measure in the module docstring."""
    return ENTRY_OVERHEAD_BYTES + BYTES_PER_GRAMMAR_BYTE * len(grammar.encode())


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer: a matcher in its initial state, never advanced (each request gets a deep
    copy, which shares the compiled grammar and lexer), and the tokens it disallows first, computed once."""

    matcher: Any  # llguidance.LLMatcher
    first_disallowed: torch.Tensor  # bool [vocab], True where the first token may not be
    first_mask_s: float  # CPU time the first mask took
    nbytes: int  # `estimate_bytes` of its grammar


class GrammarCache:
    """Least recently used compiled grammars whose estimated bytes stay within `budget_bytes` (0 keeps none)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, entry: CompiledGrammar) -> None:
        """Keeps `entry`, dropping the least recently used until all fit; one larger than the budget is not kept."""
        if entry.nbytes > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.budget_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    @property
    def nbytes(self) -> int:
        """The estimated bytes of the entries kept."""
        return self._bytes

    def keys(self) -> list[str]:
        """The keys kept, least recently used first."""
        with self._lock:
            return list(self._entries)
