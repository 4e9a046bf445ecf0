"""One request's grammar state for the engine (a `TokenConstraint`), its token masks computed ahead and in parallel.

When a token is recorded (`advance`, on the engine thread) the mask for the next one is handed to a small pool of
threads; llguidance drops the GIL while it computes, so masks of many rows are computed at once and beside the
engine's next forward pass, and `mask` usually finds its mask ready. A row whose masks cost more CPU time than
`MaskBudget` allows ends with `ConstraintFailed` (the request's fault, a 400), so that one costly grammar cannot
stall every other row of the batch step after step.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

import llguidance.numpy
import numpy as np
import torch
from numpy.typing import NDArray

from transformers_openai.engine.errors import ConstraintFailed


@dataclass(frozen=True)
class MaskBudget:
    """CPU time a row's masks may take: `grace_s` at first (a schema's first masks build lexer states), then
    `per_token_s` for each mask on average: several times what an ordinary JSON schema's masks take, well below what
    a pattern like `^x{20000}$` costs (the tests measure both sides)."""

    grace_s: float = 0.020
    per_token_s: float = 0.0005

    def allows(self, spent_s: float, masks: int) -> bool:
        return spent_s <= self.grace_s + self.per_token_s * masks


def llguidance_error(text: str) -> str:
    """llguidance's error message without its (empty, non-verbose) parser-state dump."""
    return text.replace("<non-verbose/>", "").strip()


def disallowed_tokens(bitmask: NDArray[np.int32], vocab: int) -> torch.Tensor:
    """The bool [vocab] tensor of the tokens a one-row llguidance bitmask does not allow.

    Token i is allowed when bit i % 32 of little-endian word i // 32 is set: the words' bytes unpacked little-endian
    first are the tokens in order. (Not llguidance's own helper: a torch.compile kernel, compiled on first use.)
    The bitmask is llguidance's numpy one: its torch module compiles that kernel as it is imported, which took half
    of a server's import time.
    """
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits == 0)


class MaskWorkers:
    """The threads that compute masks, shared by every constraint of a server: one less than the CPUs, at most 8."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or min(8, max(1, len(os.sched_getaffinity(0)) - 1))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, job: Any) -> Future[tuple[torch.Tensor, float]]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar-mask")
            return self._pool.submit(job)


class GrammarConstraint:
    """One request's grammar: masks the logits of the tokens it does not allow next, advances per token.

    Only the engine thread calls it; while a mask is being computed no other call touches the matcher (`mask` waits
    for it first), since llguidance's matcher is not to be used from two threads at once.
    """

    def __init__(
        self, matcher: Any, vocab_size: int, first_disallowed: torch.Tensor, workers: MaskWorkers, budget: MaskBudget
    ) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._workers = workers
        self._budget = budget
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._disallowed: torch.Tensor | None = first_disallowed  # of the next token, once known
        self._pending: Future[tuple[torch.Tensor, float]] | None = None
        self._failure: ConstraintFailed | None = None
        self._done = False
        self._spent_s = 0.0  # CPU time of its masks and advances, the first mask (computed once a schema) aside
        self._masks = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def spent_s(self) -> float:
        """CPU time its masks and advances took so far."""
        return self._spent_s

    def mask(self, logits: torch.Tensor) -> None:
        disallowed = self._next_disallowed()
        logits[: self._vocab].masked_fill_(disallowed.to(device=logits.device), float("-inf"))
        logits[self._vocab :] = float("-inf")  # the model's padding beyond the tokenizer's vocabulary

    def advance(self, token_id: int) -> None:
        if self._failure is not None:
            raise self._failure
        self._wait()  # a mask computed but not used (e.g. the row was sampled without this constraint's help)
        start = time.thread_time()
        accepted = self._matcher.consume_token(token_id)
        self._spent_s += time.thread_time() - start
        if not accepted:
            self._fail(
                f"the answer's grammar failed at token {token_id}: {llguidance_error(self._matcher.get_error())}"
            )
        self._done = bool(self._matcher.is_stopped())
        self._disallowed = None
        if not self._done:
            self._pending = self._workers.submit(self._compute)

    def is_done(self) -> bool:
        return self._done

    def _next_disallowed(self) -> torch.Tensor:
        if self._failure is not None:
            raise self._failure
        if self._disallowed is None:
            if self._pending is None:  # a mask before any token was recorded since the last one: not expected
                self._pending = self._workers.submit(self._compute)
            self._wait()
        if self._disallowed is None:
            self._fail(f"the answer's grammar failed: {llguidance_error(self._matcher.get_error()) or 'no mask'}")
        return self._disallowed

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            disallowed, spent = pending.result()
        except Exception as exc:  # llguidance refusing a call: this request's grammar only
            self._fail(f"the answer's grammar failed: {exc}")
        self._spent_s += spent
        self._masks += 1
        if self._matcher.is_error():
            self._fail(f"the answer's grammar failed: {llguidance_error(self._matcher.get_error())}")
        if not self._budget.allows(self._spent_s, self._masks):
            self._fail(
                f"the answer's grammar is too costly to follow: its token masks took {self._spent_s * 1000:.0f} ms "
                f"of CPU time for {self._masks} tokens (at most {self._budget.grace_s * 1000:.0f} ms, then "
                f"{self._budget.per_token_s * 1000:.1f} ms a token); simplify its patterns or repetitions"
            )
        self._disallowed = disallowed

    def _compute(self) -> tuple[torch.Tensor, float]:
        """On a mask worker: the next token's mask, and the CPU time it took."""
        start = time.thread_time()
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        disallowed = disallowed_tokens(self._bitmask, self._vocab)
        return disallowed, time.thread_time() - start

    def _fail(self, message: str) -> NoReturn:
        self._failure = ConstraintFailed(message)
        raise self._failure
