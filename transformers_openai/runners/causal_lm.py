"""Runner for decoder-only language models (AutoModelForCausalLM)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from transformers_openai.int8_linear import quantizes_activations
from transformers_openai.runners.base import (
    Acceleration,
    DecodeRow,
    DecodeStep,
    PrefillOutput,
    PrefillRow,
    Prepared,
    RunnerSpec,
    Step,
    StepOutput,
)
from transformers_openai.runners.kernels import paged_decode_kernel
from transformers_openai.runners.kernels.paged_attention import use_paged_attention
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_pool import KVPool, KVSpace
from transformers_openai.runners.lora.layers import LoraRows, LoraWeightsLike, rows_using, wrap_linear_layers
from transformers_openai.runners.prefill_groups import length_groups
from transformers_openai.runners.steps.background_steps import BackgroundSteps
from transformers_openai.runners.steps.fixed_steps import FixedSteps
from transformers_openai.runners.steps.paged_step import PagedStep, StepExecutor

logger = logging.getLogger(__name__)

# Padding a batched prefill may add, as a share of its real tokens. On a CPU padding costs its arithmetic; on a
# GPU a forward costs mostly its launch overhead, so fewer, more padded forwards win.
CPU_MAX_PADDING = 0.25
GPU_MAX_PADDING = 1.0


class CausalLMRunner:
    """Prefills the prompts admitted in a step together, then decodes all rows together over one paged K/V pool.

    Every forward, prefill or decode, is one step of the `PagedKVCache`: each row adds its own number of tokens
    after what its blocks already hold (a cached prefix of its prompt, earlier chunks). With plain causal attention
    the model attends through `paged_attention` (rows in groups of similar lengths). Prompts that fit whole in
    their step share forwards in groups of similar lengths (identical prompts are computed once and their K/V
    copied); a prompt chunked over several steps, or one whose logprobs are scored, is prefilled alone.

    The engine gives every row its slot and block table; `executor` runs the forwards and copies over the pool (with
    tensor parallelism, on every rank).
    """

    def __init__(self, model: PreTrainedModel, max_rows: int, max_model_len: int, kv: KVSpace | None = None) -> None:
        self.model = model
        self.device = model.device
        self.max_padding = CPU_MAX_PADDING if self.device.type == "cpu" else GPU_MAX_PADDING
        grouped = self._grouped = use_paged_attention(model)
        self._pool = KVPool(model, max_rows, max_model_len, kv, group_padding=self.max_padding if grouped else None)
        pool = self._pool.spec
        self.spec = RunnerSpec(max_rows, min(max_model_len, pool.token_capacity - 1), pool)
        self.executor: StepExecutor = PagedStep(model, self._pool.cache, grouped)
        self.fixed: FixedSteps | None = None  # steps of fixed shapes (`fix_steps`)
        self._background: BackgroundSteps | None = None  # compiled steps on their way (`compile_in_background`)
        self.lora: LoraRows | None = None  # rows' LoRA adapters (`serve_adapters`)

    def serve_adapters(self) -> dict[str, tuple[int, int]]:
        """From now on each row may run with its own LoRA adapter (`PrefillRow.lora`, `DecodeRow.lora`): the linear
        layers of the model's blocks are wrapped to add each adapter's update to its rows. Returns the layers an
        adapter may target, (in, out) features by name. Call it before `prepare`: steps then run eagerly (fixed and
        compiled steps do not carry adapters)."""
        self.lora, shapes = wrap_linear_layers(self.model)
        return shapes

    def _adapters(self, adapters: Sequence[LoraWeightsLike | None]) -> AbstractContextManager[None]:
        """The forwards run inside apply `adapters[i]` to row `i`."""
        return rows_using(self.lora, adapters, self.device)

    def prepare(self, acceleration: Acceleration) -> Prepared:
        """Tensor parallelism first (the executor runs each step on every rank), then CUDA graphs, or on a CPU the
        compiled decode step (plain causal attention run by this process alone: see `fix_steps`)."""
        if self.lora is not None and acceleration.distribute is not None:
            raise ValueError("LoRA adapters are not served under tensor parallelism")
        if acceleration.distribute is not None:
            self.executor = acceleration.distribute(self.executor)
        elif acceleration.kernels and quantizes_activations(self.model):
            self.attend_per_query(acceleration.store)
        if self.lora is not None:
            logger.info("LoRA adapters: steps run eagerly (no compiled decode step, no CUDA graphs)")
            return Prepared()
        if acceleration.graphs and self.fix_steps(graphs=True):
            return Prepared(("CUDA graphs",), asynchronous=True)
        elsewhere, store = acceleration.compile_elsewhere, acceleration.store
        if acceleration.compiled and elsewhere is not None and store is not None:
            if self.compile_in_background(store, elsewhere, acceleration.on_compiled):
                return Prepared(("decode step compiling in the background",))
            return Prepared()
        if acceleration.compiled and self.fix_steps(
            graphs=False, compiled=True, prefills=False, store=acceleration.store
        ):
            return Prepared(("compiled decode step",))
        return Prepared()

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
        fixed = self._fixed_steps(graphs if buckets is None else buckets, prefills)
        if fixed is None:
            return False
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

    @torch.inference_mode()
    def compile_in_background(
        self,
        store: Path,
        compile_elsewhere: Callable[[], None],
        on_compiled: Callable[[DecodeStep], None] | None = None,
    ) -> bool:
        """Decode steps run eagerly now and compiled once `compile_elsewhere` has compiled them into `store` (or
        at once from there where an earlier start did) and they are loaded: swapped in by `execute` between two
        steps (`background_steps.py`). False where compiled steps do not apply (as `fix_steps`)."""
        fixed = self._fixed_steps(buckets=False, prefills=False)
        if fixed is None:
            return False
        self._background = BackgroundSteps(fixed, store, self._layout(), compile_elsewhere, on_compiled)
        self._background.start()
        return True

    def _fixed_steps(self, buckets: bool, prefills: bool) -> FixedSteps | None:
        """Fixed steps over this runner's pool (`fixed_steps.py`), not yet stepping; None where they do not apply
        (plain causal attention run by this process's own executor only)."""
        if not self._grouped or not isinstance(self.executor, PagedStep):
            return None
        pool, max_rows = self.spec.kv_pool, self.spec.max_rows
        max_blocks = min(pool.blocks_for(self.spec.max_model_len + 1), pool.usable)
        # A step may read as many columns as the pool holds tokens (at least two blocks a row: short steps fit).
        most = max(pool.usable * pool.block_size, max_rows * pool.block_size * 2)
        cache = self._pool.cache
        return FixedSteps(self.executor.forward_planned, cache, max_rows, max_blocks, buckets, most, prefills)

    def _swap_steps(self) -> None:
        """Compiled steps made ready in the background are taken here, between two steps."""
        background = self._background
        assert background is not None
        done = background.finished.is_set()  # before `take`: steps made ready before it was set are taken now
        fixed = background.take()
        if fixed is not None:
            self.fixed = fixed
        if fixed is not None or done:
            self._background = None

    def attend_per_query(self, store: Path | None) -> bool:
        """Every query attends alone, through the kernel that reads the pool in place, so a row's answer does not
        depend on the rows beside it. Where activations are rounded to int8 per token (`int8_linear.py`), the last
        bits of a float difference (sdpa's result moves with a group's width and queries) round an activation a
        step the other way, and greedy answers under batching part from the same request alone. float32 K/V and
        plain causal attention only; False where it does not apply or the kernel cannot be built."""
        cache = self._pool.cache
        if not self._grouped or cache.device.type != "cpu" or cache.geometry.dtype != torch.float32:
            return False
        if store is None:
            with tempfile.TemporaryDirectory(prefix="transformers-openai-") as scratch:
                loaded = paged_decode_kernel.load(Path(scratch))
        else:
            loaded = paged_decode_kernel.load(store)
        if not loaded:
            logger.warning("no in-place attention kernel: int8 answers may depend on the batch they run in")
            return False
        cache.per_query = True
        logger.info("every query attends alone (in-place kernel): answers do not depend on the batch")
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

    def prefill_cost(self, encoder_inputs: Mapping[str, Any]) -> int:
        return 0  # its tokens are the whole cost

    @torch.inference_mode()
    def execute(self, step: Step) -> StepOutput:
        if self._background is not None:
            self._swap_steps()
        if step.probe:  # writes the rows' next slots, which nothing records: the next real step overwrites them
            with self._adapters([row.lora for row in step.decodes]):
                self._step([(row.table, [row.token]) for row in step.decodes], keep=1)
            return StepOutput()
        prefills = self._prefill(step.prefills) if step.prefills else []
        if not step.decodes:
            return StepOutput(prefills)
        slots, logits = self._decode(step.decodes)
        return StepOutput(prefills, slots, logits)

    def _prefill(self, rows: Sequence[PrefillRow]) -> list[PrefillOutput | Exception]:
        """Rows whose prompt goes in whole, unscored, share forwards in groups of similar lengths (identical ones
        computed once); the others go alone. A row that fails alone gets its exception; the others go on."""
        outcomes: list[PrefillOutput | Exception | None] = [None] * len(rows)
        alone: list[int] = []
        # Each distinct prompt taken whole -> the rows that have it: the same blocks held (a cached prefix), the same
        # tokens added.
        same: dict[tuple[tuple[int, ...], tuple[int, ...], int], list[int]] = {}
        block_size = self.spec.kv_pool.block_size
        for i, row in enumerate(rows):
            if row.last and not row.score and row.tokens:
                held = tuple(row.table.blocks[: -(-row.table.length // block_size)])
                same.setdefault((held, tuple(row.tokens), id(row.lora)), []).append(i)
            else:
                alone.append(i)
        keys = list(same)
        for group in length_groups([len(tokens) for _, tokens, _ in keys], self.max_padding):
            firsts = [rows[same[keys[g]][0]] for g in group]
            try:
                with self._adapters([row.lora for row in firsts]):
                    logits = self._forward([(row.table, row.tokens) for row in firsts], keep=1)
            except Exception:  # one prompt may be at fault: each of them alone, failing alone
                alone.extend(i for g in group for i in same[keys[g]])
                continue
            for g, first, row_logits in zip(group, firsts, logits, strict=True):
                for i in same[keys[g]][1:]:
                    try:
                        self._copy_prompt(first, rows[i])
                    except Exception as exc:  # that row's failure only
                        outcomes[i] = exc
                for i in same[keys[g]]:
                    if outcomes[i] is None:
                        outcomes[i] = PrefillOutput(row_logits[-1:])
        for i in alone:
            row = rows[i]
            try:
                with self._adapters([row.lora]):
                    logits = self._forward([(row.table, row.tokens)], keep=0 if row.score else 1)
                outcomes[i] = PrefillOutput(logits[0])
            except Exception as exc:  # that row's failure only
                outcomes[i] = exc
        return [outcome if outcome is not None else RuntimeError("row not run") for outcome in outcomes]

    def _forward(self, rows: Sequence[tuple[BlockTable, list[int]]], keep: int) -> torch.Tensor:
        """One step adding each row's tokens after what its table holds; logits `[rows, keep or tokens, vocab]`."""
        logits = self.fixed.prefill(rows) if self.fixed is not None and keep == 1 else None
        return logits if logits is not None else self._step(rows, keep)

    def _copy_prompt(self, source: PrefillRow, target: PrefillRow) -> None:
        """An identical prompt computed once: `target` gets a copy of `source`'s K/V beyond its own cached prefix."""
        start = target.table.length
        length = start + len(target.tokens)
        self.executor.copy_slots(*self._pool.copy_slots(source.table, target.table, length, start))

    def _decode(self, rows: Sequence[DecodeRow]) -> tuple[list[int], torch.Tensor]:
        order = [row.slot for row in rows]
        with self._adapters([row.lora for row in rows]):
            if any(row.draft for row in rows):
                return order, self._verify(rows)
            held = [row.table for row in rows]
            tokens = [row.token for row in rows]
            logits = None if self.fixed is None else self.fixed.decode(order, held, tokens)
            if logits is None:  # no fixed steps, or this one is wider than they take
                logits = self._step([(row.table, [row.token]) for row in rows], keep=1)[:, -1].float()
        return order, logits

    def _verify(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """A decode step whose rows carry drafts: one eager forward of each row's fed token and draft (rows
        right-aligned); the logits of each row's 1 + len(draft) positions, concatenated `[positions, vocab]`."""
        logits = self._step([(row.table, [row.token, *row.draft]) for row in rows], keep=0)
        queries = logits.shape[1]
        return torch.cat([logits[i, queries - 1 - len(row.draft) :] for i, row in enumerate(rows)]).float()

    def _step(self, rows: Sequence[tuple[BlockTable, list[int]]], keep: int) -> torch.Tensor:
        return self.executor.forward(rows, keep)

    def release(self, slot: int) -> None:
        if self.fixed is not None:
            self.fixed.forget(slot)
