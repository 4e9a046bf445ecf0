"""Every rank of a tensor-parallel model runs the same step: rank 0's executor sends each call to the others first.

Only rank 0 keeps rows: it schedules, holds the block tables and samples. The other ranks hold no request state at
all, only their shards of the weights and of the K/V pool, indexed by the block tables each call carries. So a row
freed on rank 0 (finished, cancelled, preempted) is free on every rank, and a rank's pool can never drift from
rank 0's tables.

A step that fails on one rank while the others run it leaves them waiting in a collective that will never complete:
the rank it failed on exits instead (its peers follow, see `parallel/processes.py`). A tensor-parallel server gives
up the isolation of a failing step for this: it never hangs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from transformers_openai.logs import flush_logs
from transformers_openai.parallel.ranks import Ranks
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.steps.paged_step import StepExecutor, StepRows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Forward:
    rows: list[tuple[list[int], int, list[int]]]  # each row's blocks, the tokens they hold, its new tokens
    keep: int


@dataclass(frozen=True)
class CopySlots:
    source: list[int]
    target: list[int]


@dataclass(frozen=True)
class Stop:
    """The server is done: the rank exits."""


def leave(error: BaseException) -> NoReturn:
    """Ends this rank at once: a step failed here while the other ranks ran it."""
    logger.critical(
        "a step failed on this rank while the other ranks ran it (%r): they are out of step; exiting", error
    )
    flush_logs()
    os._exit(1)


class LockstepExecutor:
    """Rank 0's executor: sends each call to the other ranks, then runs it on its own shard (`out_of_step` is called
    when that fails)."""

    def __init__(
        self, local: StepExecutor, ranks: Ranks, out_of_step: Callable[[BaseException], NoReturn] = leave
    ) -> None:
        self._local = local
        self._ranks = ranks
        self._out_of_step = out_of_step

    def forward(self, rows: StepRows, keep: int) -> torch.Tensor:
        self._ranks.send(Forward([(list(table.blocks), table.length, list(tokens)) for table, tokens in rows], keep))
        try:
            return self._local.forward(rows, keep)
        except Exception as exc:
            self._out_of_step(exc)

    def copy_slots(self, source: Sequence[int], target: Sequence[int]) -> None:
        self._ranks.send(CopySlots(list(source), list(target)))
        try:
            self._local.copy_slots(source, target)
        except Exception as exc:
            self._out_of_step(exc)

    def stop(self) -> None:
        """Tells the other ranks to exit (call it once no step can follow)."""
        self._ranks.send(Stop())


@torch.inference_mode()
def follow(executor: StepExecutor, ranks: Ranks) -> None:
    """A rank other than 0: runs rank 0's calls until it says stop. A call that fails here raises (the rank exits)."""
    while True:
        message = ranks.receive()
        if isinstance(message, Forward):
            rows = [(BlockTable(None, blocks, length), tokens) for blocks, length, tokens in message.rows]
            executor.forward(rows, message.keep)
        elif isinstance(message, CopySlots):
            executor.copy_slots(message.source, message.target)
        elif isinstance(message, Stop):
            return
        else:
            raise TypeError(f"unknown call {type(message).__name__} from rank 0")
