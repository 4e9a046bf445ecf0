"""Gives freed heap memory back to the system after a large request body.

glibc raises its mmap threshold after a large block is freed, so the next large bodies come from the heap,
and a heap keeps what is freed for reuse: a few 10 MB bodies refused at once would leave the process hundreds
of MB larger for good. `malloc_trim` returns the free pages; elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


class HeapTrimmer:
    """Calls glibc's `malloc_trim(0)` when available."""

    def __init__(self) -> None:
        self._trim: Callable[[int], int] | None = None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            self._trim = getattr(libc, "malloc_trim", None)
        except OSError:
            self._trim = None

    def __call__(self) -> None:
        if self._trim is not None:
            self._trim(0)
