"""Every rank of a tensor-parallel model runs the same step: rank 0's executor sends each call to the others first.

Only rank 0 keeps rows: it schedules, holds the block tables and samples. The other ranks hold no request state at
all, only their shards of the weights and of the K/V pool, indexed by the block tables each call carries. So a row
freed on rank 0 (finished, cancelled, preempted) is free on every rank, and a rank's pool can never drift from
rank 0's tables.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transformers_openai.parallel.ranks import Ranks
from transformers_openai.runners.block_pool import BlockTable
from transformers_openai.runners.paged_step import StepExecutor, StepRows

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


class LockstepExecutor:
    """Rank 0's executor: sends each call to the other ranks, then runs it on its own shard."""

    def __init__(self, local: StepExecutor, ranks: Ranks) -> None:
        self._local = local
        self._ranks = ranks

    def forward(self, rows: StepRows, keep: int) -> torch.Tensor:
        self._ranks.send(Forward([(list(table.blocks), table.length, list(tokens)) for table, tokens in rows], keep))
        return self._local.forward(rows, keep)

    def copy_slots(self, source: Sequence[int], target: Sequence[int]) -> None:
        self._ranks.send(CopySlots(list(source), list(target)))
        self._local.copy_slots(source, target)

    def stop(self) -> None:
        """Tells the other ranks to exit (call it once no step can follow)."""
        self._ranks.send(Stop())


@torch.inference_mode()
def follow(executor: StepExecutor, ranks: Ranks) -> None:
    """A rank other than 0: runs rank 0's calls until it says stop.

    A call that fails here fails on rank 0 too (same inputs, same shapes), where the engine handles it; this rank
    logs it and waits for the next.
    """
    while True:
        message = ranks.receive()
        try:
            if isinstance(message, Forward):
                executor.forward(
                    [(BlockTable(None, blocks, length), tokens) for blocks, length, tokens in message.rows],
                    message.keep,
                )
            elif isinstance(message, CopySlots):
                executor.copy_slots(message.source, message.target)
            elif isinstance(message, Stop):
                return
            else:
                raise TypeError(f"unknown call {type(message).__name__} from rank 0")
        except Exception:
            logger.exception("rank %d: a call from rank 0 failed", ranks.rank)
