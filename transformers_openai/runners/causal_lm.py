"""Runner for decoder-only language models (AutoModelForCausalLM)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from transformers_openai.runners.base import (
    DecodeRows,
    KVPoolSpec,
    LogitsProcessor,
    OneByOnePrefill,
    PrefillJob,
    PrefillResult,
)
from transformers_openai.runners.kernels.paged_attention import use_paged_attention
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_pool import KVPool, KVSpace
from transformers_openai.runners.prefill_groups import length_groups
from transformers_openai.runners.steps.fixed_steps import FixedSteps
from transformers_openai.runners.steps.paged_step import PagedStep, StepExecutor

logger = logging.getLogger(__name__)

# A scored prompt is prefilled in chunks of at most this many tokens, so its full logits stay small.
SCORED_CHUNK_TOKENS = 512
# Padding a batched prefill may add, as a share of its real tokens. On a CPU padding costs its arithmetic; on a
# GPU a forward costs mostly its launch overhead, so fewer, more padded forwards win.
CPU_MAX_PADDING = 0.25
GPU_MAX_PADDING = 1.0


class CausalLMRunner(OneByOnePrefill):
    """Prefills the prompts admitted in a step together, then decodes all rows together over one paged K/V pool.

    Every forward, prefill or decode, is one step of the `PagedKVCache`: each row adds its own number of tokens
    after what its blocks already hold (a cached prefix of its prompt, earlier chunks). With plain causal attention
    the model attends through `paged_attention` (rows in groups of similar lengths). Prompts that fit whole in
    their step share forwards in groups of similar lengths (identical prompts are computed once and their K/V
    copied); a prompt chunked over several steps, or one whose logprobs are scored, is prefilled alone.

    The engine's K/V manager gives every job and row its block table; `executor` runs the forwards and copies over
    the pool (with tensor parallelism, on every rank).
    """

    logits_processors: Sequence[LogitsProcessor] = ()

    def __init__(self, model: PreTrainedModel, max_rows: int, max_model_len: int, kv: KVSpace | None = None) -> None:
        self.model = model
        self.max_rows = max_rows
        self.device = model.device
        self.max_padding = CPU_MAX_PADDING if self.device.type == "cpu" else GPU_MAX_PADDING
        grouped = self._grouped = use_paged_attention(model)
        self._pool = KVPool(model, max_rows, max_model_len, kv, group_padding=self.max_padding if grouped else None)
        self.kv_pool: KVPoolSpec = self._pool.spec
        self.executor: StepExecutor = PagedStep(model, self._pool.cache, grouped)
        self.max_model_len = min(max_model_len, self.kv_pool.token_capacity - 1)
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self.fixed: FixedSteps | None = None  # steps of fixed shapes (`fix_steps`)

    @torch.inference_mode()
    def fix_steps(
        self,
        graphs: bool,
        buckets: bool | None = None,
        compiled: bool = False,
        prefills: bool = True,
        store: Path | None = None,
    ) -> bool:
        """Decode steps, and prefills of short prompts when `prefills`, from now on run from persistent buffers
        (`fixed_steps.py`): as CUDA graphs captured here when `graphs`, else eagerly or, when `compiled`, decode
        steps compiled by `torch.compile` (kept in `store` between starts); padded to buckets when `buckets`
        (default: as graphs are). Only for plain causal attention run by this process's own executor (not under
        tensor parallelism); False where it does not apply, or where the graphs could not be captured or compiled
        (steps then run as before)."""
        if not self._grouped or not isinstance(self.executor, PagedStep):
            return False
        pool = self.kv_pool
        max_blocks = min(pool.blocks_for(self.max_model_len + 1), pool.usable)
        padded = graphs if buckets is None else buckets
        # A step may read as many columns as the pool holds tokens (at least two blocks a row: short steps fit).
        most = max(pool.usable * pool.block_size, self.max_rows * pool.block_size * 2)
        fixed = FixedSteps(
            self.executor.forward_planned, self._pool.cache, self.max_rows, max_blocks, padded, most, prefills
        )
        try:
            if compiled:
                self._read_in_place(fixed, store)
                fixed.compile(store, self._layout())
            if graphs:
                fixed.capture()
        except Exception:  # e.g. a quantized layer's kernel that cannot be captured: eager steps still serve
            what = "CUDA graphs could not be captured" if graphs else "the decode step could not be compiled"
            logger.warning("%s: steps run eagerly", what, exc_info=True)
            return False
        self.fixed = fixed
        return True

    @staticmethod
    def _read_in_place(fixed: FixedSteps, store: Path | None) -> None:
        """Decode attention through the kernel that reads the pool in place, kept in `store` (else built for this
        process alone: once loaded, its file is not needed)."""
        if store is not None:
            fixed.read_in_place(store)
            return
        with tempfile.TemporaryDirectory(prefix="transformers-openai-") as scratch:
            fixed.read_in_place(Path(scratch))

    def _layout(self) -> list[str]:
        """What a compiled step depends on in the model: its configuration and its weights' types, shapes, dtypes
        and layouts (oneDNN-packed or not)."""
        modules = [f"{name}:{type(module).__name__}" for name, module in self.model.named_modules()]
        tensors = [
            f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.layout}"
            for name, tensor in (*self.model.named_parameters(), *self.model.named_buffers())
        ]
        return [self.model.config.to_json_string(), *modules, *tensors]

    def output_limit(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len

    def prefill_overhead(self, job: PrefillJob) -> int:
        return 0  # its tokens are the whole cost

    def decoder_prompt(self, job: PrefillJob) -> list[int]:
        return job.prompt_token_ids

    @torch.inference_mode()
    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        outcomes: list[PrefillResult | Exception] = [None] * len(jobs)
        alone: list[int] = []
        same: dict[tuple[int, ...], list[int]] = {}  # each distinct prompt taken whole -> the jobs that have it
        for i, (job, take) in enumerate(jobs):
            if job.kv is None:
                outcomes[i] = RuntimeError("a prefill needs the block table the engine's K/V manager reserves for it")
            elif job.prompt_logprobs is None and 0 < job.remaining <= take:
                same.setdefault((job.done, *job.prompt_token_ids), []).append(i)
            else:
                alone.append(i)
        keys = list(same)
        for group in length_groups([len(key) - key[0] for key in keys], self.max_padding):
            firsts = [jobs[same[keys[g]][0]][0] for g in group]
            try:
                logits = self._forward([(job, job.prompt_token_ids[job.done :]) for job in firsts], keep=1)
            except Exception:  # one prompt may be at fault: each of them alone, failing alone
                alone.extend(i for g in group for i in same[keys[g]])
                continue
            for g, first, row_logits in zip(group, firsts, logits, strict=True):
                copies, last = same[keys[g]][1:], row_logits[-1].float()
                for i in copies:  # before the first joins: its table is read
                    try:
                        self._copy_prompt(first, jobs[i][0])
                    except Exception as exc:  # that job's failure only
                        outcomes[i] = exc
                for i in same[keys[g]]:
                    if outcomes[i] is None:
                        outcomes[i] = self._join(jobs[i][0]), last
        for i in alone:
            try:
                outcomes[i] = self.prefill(*jobs[i])
            except Exception as exc:  # that job's failure only
                outcomes[i] = exc
        return outcomes

    @torch.inference_mode()
    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        scoring = job.prompt_logprobs is not None
        take = max(max_tokens, 1) if not scoring else min(max(max_tokens, 1), SCORED_CHUNK_TOKENS)
        start, end = job.done, min(len(job.prompt_token_ids), job.done + take)
        logits = self._forward([(job, job.prompt_token_ids[start:end])], keep=0 if scoring else 1)[0]
        if scoring:
            _score(job, logits, start, end)
        if end < len(job.prompt_token_ids):
            return None
        return self._join(job), logits[-1].float()

    def _forward(self, rows: list[tuple[PrefillJob, list[int]]], keep: int) -> torch.Tensor:
        """One step adding each job's `tokens` after what its table holds; logits `[rows, keep or tokens, vocab]`."""
        tables = [(job.table, tokens) for job, tokens in rows]
        logits = self.fixed.prefill(tables) if self.fixed is not None and keep == 1 else None
        if logits is None:
            logits = self._step(tables, keep)
        for job, tokens in rows:
            job.done += len(tokens)
        return logits

    def _copy_prompt(self, source: PrefillJob, target: PrefillJob) -> None:
        """An identical prompt computed once: `target` gets a copy of `source`'s K/V beyond its own cached prefix."""
        start, length = target.done, len(source.prompt_token_ids)
        self.executor.copy_slots(*self._pool.copy_slots(source.table, target.table, length, start))
        target.done = length

    def _join(self, job: PrefillJob) -> int:
        return self._free_slots.pop()

    @torch.inference_mode()
    def decode(self, rows: DecodeRows) -> tuple[list[int], torch.Tensor]:
        order = list(rows)
        held = [rows[slot][0] for slot in order]
        tokens = [rows[slot][1] for slot in order]
        logits = None if self.fixed is None else self.fixed.decode(order, held, tokens)
        if logits is None:  # no fixed steps, or this one is wider than they take
            logits = self._step([(table, [token]) for table, token in zip(held, tokens, strict=True)], keep=1)
            logits = logits[:, -1].float()
        return order, logits

    @torch.inference_mode()
    def probe(self, rows: DecodeRows) -> None:
        # The step writes the rows' next slots, which nothing records: the next real step overwrites them.
        self._step([(table, [token]) for table, token in rows.values()], keep=1)

    def _step(self, rows: Sequence[tuple[BlockTable, list[int]]], keep: int) -> torch.Tensor:
        return self.executor.forward(rows, keep)

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)
        if self.fixed is not None:
            self.fixed.forget(slot)

    def rows_in_use(self) -> int:
        return self.max_rows - len(self._free_slots)


def _score(job: PrefillJob, logits: torch.Tensor, start: int, end: int) -> None:
    """Appends the logprobs of the prompt tokens the chunk `start..end` predicts (start+1 .. end, within the prompt)."""
    targets = job.prompt_token_ids[start + 1 : end + 1]
    if not targets:
        return
    logprobs = logits[: len(targets)].float().log_softmax(dim=-1)
    picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
    chosen = picked[:, 0].tolist()
    ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()
    k = job.prompt_logprobs or 0
    if k:
        values, indices = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in targets]
    job.prompt_scores.extend(zip(chosen, ranks, tops, strict=True))
