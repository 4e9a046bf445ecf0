"""The engine's side of the runner seam, for tests that drive a runner without an engine: the rows' slots, the K/V
manager's block tables (reserved before a prefill, grown before a decode step, recorded after each) and the step
descriptions the runner executes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from transformers_openai.engine.kv_manager import KVManager, KVUsage
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.engine.row_slots import RowSlots
from transformers_openai.runners.base import DecodeRow, ModelRunner, Step

PrefillResult = tuple[int, torch.Tensor] | None  # (the row's slot, next-token logits) once its prompt is in


class RunnerDriver:
    """Calls a runner the way `EngineCore` does, with rows named by slot and fed their last token."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.spec = runner.spec
        self.kv = KVManager(self.spec.kv_pool)
        self.slots = RowSlots(self.spec.max_rows)
        self.jobs: dict[int, PrefillJob] = {}  # the admitted jobs (and their block tables) by slot

    def job(
        self, prompt: list[int], encoder_inputs: Mapping[str, object] | None = None, prompt_logprobs: int | None = None
    ) -> PrefillJob:
        """A request's prompt as the engine records it (the decoder's prompt as the runner's spec says)."""
        return PrefillJob(self.spec.decoder_prompt(prompt), encoder_inputs or {}, prompt_logprobs=prompt_logprobs)

    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        [outcome] = self.prefill_batch([(job, max_tokens)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        rows = [job.next_row(self._admit(job), take, self.spec.whole_prompt) for job, take in jobs]
        outputs = self.runner.execute(Step(prefills=rows)).prefills
        results: list[PrefillResult | Exception] = []
        for (job, _), row, output in zip(jobs, rows, outputs, strict=True):
            if isinstance(output, Exception):
                self.release(row.slot)
                results.append(output)
                continue
            logits = job.took(row, output.logits, output.info)
            self.kv.prefilled(job)
            results.append((row.slot, logits) if logits is not None else None)
        return results

    def decode(self, last_tokens: Mapping[int, int]) -> tuple[list[int], torch.Tensor]:
        assert self.kv.grow(job.table for job in self.jobs.values()), "the K/V pool is short"
        rows = self._rows(last_tokens)
        out = self.runner.execute(Step(decodes=rows))
        for row in rows:
            self.kv.written(row.table, [row.token])
        assert out.logits is not None
        return list(out.slots), out.logits

    def probe(self, last_tokens: Mapping[int, int]) -> None:
        self.runner.execute(Step(decodes=self._rows(last_tokens), probe=True))

    def release(self, slot: int) -> None:
        self.runner.release(slot)
        self.slots.give_back(slot)
        self.kv.release(self.jobs.pop(slot))

    def rows_in_use(self) -> int:
        return self.slots.in_use

    def kv_usage(self) -> KVUsage:
        return self.kv.usage()

    def _admit(self, job: PrefillJob) -> int:
        """The job's slot: the one it holds (a chunked prefill going on), or a new one with its block table."""
        for slot, held in self.jobs.items():
            if held is job:
                return slot
        free = self.slots.take()
        if free is None:
            raise MemoryError("every row is held")
        if not self.kv.reserve(job, len(job.decoder_prompt) + 1, running=len(self.jobs)):
            self.slots.give_back(free)
            raise MemoryError("the K/V pool has no room for this prompt")
        self.jobs[free] = job
        return free

    def _rows(self, last_tokens: Mapping[int, int]) -> list[DecodeRow]:
        return [
            DecodeRow(slot, self.jobs[slot].table, token, lora=self.jobs[slot].lora)
            for slot, token in last_tokens.items()
        ]
