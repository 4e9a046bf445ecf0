"""The engine's side of the runner seam, for tests that drive a runner without an engine: the K/V manager's block
tables (reserved before a prefill, grown before a decode step, recorded after each) and the rows' jobs by slot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from transformers_openai.engine.kv_manager import KVManager, KVUsage
from transformers_openai.runners.base import ModelRunner, PrefillJob, PrefillResult
from transformers_openai.runners.kv.block_table import BlockTable


class RunnerDriver:
    """Calls a runner the way `EngineCore` does, with rows named by slot and fed their last token."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv = KVManager(runner.kv_pool)
        self.jobs: dict[int, PrefillJob] = {}  # the running rows' jobs (and block tables) by slot

    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        self._reserve(job)
        try:
            result = self.runner.prefill(job, max_tokens)
        except Exception:
            self._discard(job)
            raise
        return self._prefilled(job, result)

    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        for job, _ in jobs:
            self._reserve(job)
        outcomes = self.runner.prefill_batch(jobs)
        for (job, _), outcome in zip(jobs, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._discard(job)
            else:
                self._prefilled(job, outcome)
        return outcomes

    def decode(self, last_tokens: Mapping[int, int]) -> tuple[list[int], torch.Tensor]:
        assert self.kv.grow(job.kv for job in self.jobs.values() if job.kv is not None), "the K/V pool is short"
        rows = self._rows(last_tokens)
        order, logits = self.runner.decode(rows)
        for table, token in rows.values():
            self.kv.written(table, [token])
        return order, logits

    def probe(self, last_tokens: Mapping[int, int]) -> None:
        self.runner.probe(self._rows(last_tokens))

    def release(self, slot: int) -> None:
        self.runner.release(slot)
        self.kv.release(self.jobs.pop(slot))

    def rows_in_use(self) -> int:
        return self.runner.rows_in_use()

    def kv_usage(self) -> KVUsage:
        return self.kv.usage()

    def _reserve(self, job: PrefillJob) -> None:
        tokens = len(self.runner.decoder_prompt(job)) + 1
        if not self.kv.reserve(job, tokens, running=len(self.jobs)):
            raise MemoryError("the K/V pool has no room for this prompt")

    def _prefilled(self, job: PrefillJob, result: PrefillResult) -> PrefillResult:
        self.kv.prefilled(job, self.runner.decoder_prompt(job))
        if result is not None:
            self.jobs[result[0]] = job
        return result

    def _discard(self, job: PrefillJob) -> None:
        self.runner.discard(job)
        self.kv.release(job)

    def _rows(self, last_tokens: Mapping[int, int]) -> dict[int, tuple[BlockTable, int]]:
        rows = {}
        for slot, token in last_tokens.items():
            table = self.jobs[slot].kv
            assert table is not None
            rows[slot] = (table, token)
        return rows
