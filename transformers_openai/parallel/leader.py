"""Rank 0 of a tensor-parallel server: the ranks it started, the group once joined, and its lockstep executor."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from transformers_openai.parallel.lockstep import LockstepExecutor
from transformers_openai.parallel.processes import RankProcesses
from transformers_openai.parallel.ranks import Ranks
from transformers_openai.parallel.rendezvous import LoopbackRendezvous
from transformers_openai.runners.steps.paged_step import StepExecutor

logger = logging.getLogger(__name__)


class Leader:
    """Started in `main` before the server; the loader, once the ranks joined, makes the runner lead them through
    `lead`; `main` closes it last."""

    def __init__(self, processes: RankProcesses | None) -> None:
        self._processes = processes
        self._executor: LockstepExecutor | None = None

    @classmethod
    def start(cls, size: int, argv: Sequence[str]) -> Leader:
        """Under torchrun the other ranks exist already; otherwise this process starts them."""
        return cls(None if "RANK" in os.environ else RankProcesses.start(size, argv))

    @property
    def rendezvous(self) -> LoopbackRendezvous | None:
        """Where the ranks this process started meet (None under torchrun, whose store they use)."""
        return None if self._processes is None else self._processes.rendezvous

    def lead(self, local: StepExecutor, ranks: Ranks) -> LockstepExecutor:
        """The executor the runner uses from now on: every call it runs runs on every rank."""
        self._executor = LockstepExecutor(local, ranks)
        return self._executor

    def close(self, timeout_s: float) -> bool:
        """After the engine stopped: tells the ranks to exit and waits for them (those started here); True when all
        exited cleanly."""
        told = False
        if self._executor is not None:
            try:
                self._executor.stop()
                told = True
            except Exception:
                logger.exception("telling the other ranks to stop failed")
        if self._processes is None:
            return told or self._executor is None
        return self._processes.stop(timeout_s if told else 0.0) and told
