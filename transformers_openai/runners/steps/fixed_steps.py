"""Steps of fixed shapes over the paged pool: persistent step buffers, shape buckets, CUDA graphs.

A step adds `queries` new tokens to each of its rows: one for a decode step, a prompt (or what its cached prefix
leaves of it) for a prefill. Its inputs live in buffers allocated once: the rows' new tokens, their positions and the
rows' block tables, filled on the host from the scheduler's bookkeeping and copied to the device in one transfer.
Everything else (the slots the new K/V go to, the pool slots attention reads, the mask) is computed on the device
from those buffers inside the step, so a step of a given shape is the same sequence of kernels every time:

- the rows are padded to a batch bucket (1, 2, 4, 8, then multiples of 8) and the new tokens to a query bucket
  (1 for decode; 16, 32, ... 256 for prompts, right-aligned so every row's last query is its newest token); padding
  rows and padding queries write to a trash block of the pool that no request holds;
- the block-table width is padded to a power of two, and attention reads that many blocks of each row in place of
  the pool, masked beyond each query's own position (columns past the row's newest token read the zero block, so
  slots never written cannot reach attention);
- on CUDA every bucket is captured once as a CUDA graph, all of them sharing one memory pool, and a step is one
  host-to-device copy, one graph replay and the logits it leaves (the newest token's of each row).

Without graphs (a CPU, or `--enforce-eager`) the same steps run eagerly, at their exact shapes or padded; on a CPU
decode steps run compiled by `torch.compile` (`compile`, `--cpu-compile`), kept on disk between starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformers_openai.runners.kernels import paged_decode_kernel
from transformers_openai.runners.kv.block_table import NULL_BLOCK, BlockTable
from transformers_openai.runners.kv.paged_cache import AttentionGroup, InPlaceDecode, PagedKVCache, StepPlan
from transformers_openai.runners.packed_linear import register_compilable_op
from transformers_openai.runners.steps.step_store import compiled_step, store_key, stored_step

logger = logging.getLogger(__name__)

# Prompts prefilled by captured steps: at most this many together, of at most the largest query bucket's tokens,
# over at most the widest prefill width (blocks). Larger prefills run eagerly: their arithmetic outweighs launches.
PREFILL_BATCHES = (1, 2, 4, 8)
PREFILL_QUERIES = (16, 32, 64, 128, 256)
PREFILL_MAX_BLOCKS = 32


def batch_buckets(most: int) -> list[int]:
    """The batch sizes steps are padded to: 1, 2, 4, 8, then every multiple of 8, up to `most` (always included)."""
    sizes = [size for size in (1, 2, 4) if size < most] + list(range(8, most, 8))
    return [*sizes, most]


def width_buckets(most: int) -> list[int]:
    """Block-table widths steps are padded to: powers of two up to `most` blocks (always included)."""
    sizes = []
    size = 1
    while size < most:
        sizes.append(size)
        size *= 2
    return [*sizes, most]


def _bucket(buckets: Sequence[int], value: int) -> int | None:
    return next((size for size in buckets if size >= value), None)


class FixedSteps:
    """Runs decode and prefill steps of `model` over `cache` from persistent buffers (see the module's docstring).

    Args:
        forward: runs the model over the cache for a planned step: (input ids `[rows, queries]`, position ids
            `[rows, queries]`, 4-D attention mask) -> logits `[rows, 1, vocab]` (the last query's); the cache's
            `running(plan)` is entered around it.
        max_rows: the most rows a step runs.
        max_blocks: the most blocks one row holds.
        buckets: pad every step to its buckets (what graphs need); False runs each step at its exact shape.
        most_tokens: the most columns (rows x width in tokens) a step may read; a step beyond it is not taken
            (None is returned) and buckets beyond it are not captured.
        prefills: prompts' prefills are taken too (else only decode steps).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        cache: PagedKVCache,
        max_rows: int,
        max_blocks: int,
        buckets: bool,
        most_tokens: int,
        prefills: bool = True,
    ) -> None:
        self._forward = forward
        self.prefills = prefills
        self.cache = cache
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.buckets = buckets
        self.most_tokens = most_tokens
        self.batch_buckets = batch_buckets(max_rows)
        self.width_buckets = width_buckets(max_blocks)
        self.prefill_batches = [b for b in PREFILL_BATCHES if b < max_rows] + ([max_rows] if max_rows <= 8 else [])
        self.prefill_widths = [w for w in self.width_buckets if w <= PREFILL_MAX_BLOCKS]
        self.max_queries = max(PREFILL_QUERIES)
        device = cache.device
        # One staging buffer, laid out per step shape (b rows, q queries): token ids [b x q] | positions [b x q] |
        # block tables [b x max_blocks], so a step's inputs are its first 2bq + b max_blocks entries: one copy.
        size = max_rows * (2 * self.max_queries + max_blocks)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staged: np.ndarray[Any, np.dtype[np.int64]] = self._host.numpy()
        self._device = self._host if device.type == "cpu" else torch.zeros(size, dtype=torch.int64, device=device)
        block_size = cache.block_size
        self._offsets = torch.arange(block_size, device=device)
        self._columns = torch.arange(max_blocks * block_size, device=device)
        # The block tables of the running rows by slot, extended as their tables grow.
        self._by_slot = np.full((max_rows, max_blocks), cache.trash_block, dtype=np.int64)
        self._mirrored: list[tuple[list[int], int] | None] = [None] * max_rows
        self._captured: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # graph replays so far (steps that ran as graphs)
        # The last copy out of the pinned staging buffer: the buffer is not rewritten before it has run (two
        # prefills of one engine step are staged with no synchronisation between them).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        # The compiled decode steps (`compile`) of one row, and of two rows or more (key 2).
        self._compiled: dict[int, Callable[..., torch.Tensor]] = {}
        self._least_width = 1  # the fewest blocks a decode step runs over (`compile`)
        self._in_place = False  # decode attention reads the pool in place (`read_in_place`)

    def decode(self, slots: Sequence[int], tables: Sequence[BlockTable], tokens: Sequence[int]) -> torch.Tensor | None:
        """One decode step of the rows at `slots` (their tables, each holding room for one more token) adding
        `tokens`; logits `[rows, vocab]` in float32. None (nothing run) when its shape reads more than `most_tokens`
        columns: one long row among many pads them all to its width, which the caller's grouped step avoids."""
        rows = len(slots)
        widest = self._mirror(slots, tables)
        shape = self._shape(rows, 1, widest, decode=True)
        if shape is None:
            return None
        ids, positions, blocks = self._grid(*shape)
        ids[:rows, 0] = tokens
        positions[:rows, 0] = [table.length for table in tables]
        blocks[:rows] = self._by_slot[list(slots), : shape[2]]
        return self._launch(shape)[:rows, -1].float()

    def prefill(self, rows: Sequence[tuple[BlockTable, Sequence[int]]]) -> torch.Tensor | None:
        """One step adding each table's new tokens (a prompt, or what is left of it after a cached prefix) after what
        it holds; logits `[rows, 1, vocab]` of each row's last token. None (nothing run) when the step is larger than
        the prefill buckets, or prefills are not taken."""
        if not self.prefills:
            return None
        count = len(rows)
        queries = max(len(tokens) for _, tokens in rows)
        widest = max(len(table.blocks) for table, _ in rows)
        shape = self._shape(count, queries, widest, decode=False)
        if shape is None:
            return None
        ids, positions, blocks = self._grid(*shape)
        padded = shape[1]
        for row, (table, tokens) in enumerate(rows):
            n, start = len(tokens), table.length
            ids[row, padded - n :] = tokens
            positions[row, padded - n :] = np.arange(start, start + n)
            blocks[row, : len(table.blocks)] = table.blocks
        return self._launch(shape)[:count]

    def capture(self, log_every: float = 5.0) -> None:
        """Captures every bucket as a CUDA graph (decode steps, then prompts' prefills), largest first, in one shared
        memory pool."""
        if not self.buckets or self.cache.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device and bucketed steps")
        pool = torch.cuda.graph_pool_handle()
        started = last_log = time.monotonic()
        size = self.cache.block_size
        shapes = [(b, 1, w) for b in reversed(self.batch_buckets) for w in reversed(self.width_buckets)]
        shapes += [
            (b, q, w)
            for b in (reversed(self.prefill_batches) if self.prefills else ())
            for q in reversed(PREFILL_QUERIES)
            for w in reversed(self.prefill_widths)
            if w * size >= q
        ]
        shapes = [(b, q, w) for b, q, w in shapes if b * w * size <= self.most_tokens]
        for done, shape in enumerate(shapes, 1):
            self._grid(*shape)  # every row a padding row: reads and writes the trash block
            self._upload(shape)
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(*shape)  # a first run outside the capture (lazy initialisations, workspaces)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._run(*shape)
            self._captured[shape] = (graph, logits)
            now = time.monotonic()
            if now - last_log >= log_every or done == len(shapes):
                logger.info("captured %d/%d CUDA graphs of steps (%.1f s)", done, len(shapes), now - started)
                last_log = now

    def forget(self, slot: int) -> None:
        """The row at `slot` left: its table is mirrored afresh for the next row there."""
        self._mirrored[slot] = None

    def _shape(self, rows: int, queries: int, widest: int, decode: bool) -> tuple[int, int, int] | None:
        """The (batch, queries, width) a step runs at, or None when it is not taken."""
        if rows > self.max_rows or (not decode and (queries > self.max_queries or widest > PREFILL_MAX_BLOCKS)):
            return None
        if not self.buckets:
            batch, padded, width = rows, queries, widest
            if decode:
                width = max(width, self._least_width)
        else:
            found_batch = _bucket(self.batch_buckets if decode else self.prefill_batches, rows)
            found_queries = 1 if decode else _bucket(PREFILL_QUERIES, queries)
            found_width = _bucket(self.width_buckets if decode else self.prefill_widths, widest)
            if found_batch is None or found_queries is None or found_width is None:
                return None
            batch, padded, width = found_batch, found_queries, found_width
        if batch * width * self.cache.block_size > self.most_tokens:
            return None
        return batch, padded, width

    def _mirror(self, slots: Sequence[int], tables: Sequence[BlockTable]) -> int:
        """Brings the by-slot block tables up to date (only the blocks added since the last step); returns the most
        blocks a row holds."""
        widest = 1
        for slot, table in zip(slots, tables, strict=True):
            blocks = table.blocks
            count = len(blocks)
            known = self._mirrored[slot]
            if known is None or known[0] is not blocks:
                self._by_slot[slot, :count] = blocks
                self._by_slot[slot, count:] = self.cache.trash_block
                self._mirrored[slot] = (blocks, count)
            elif known[1] != count:
                self._by_slot[slot, known[1] : count] = blocks[known[1] :]
                self._mirrored[slot] = (blocks, count)
            widest = max(widest, count)
        return widest

    def _grid(self, batch: int, queries: int, width: int) -> tuple[np.ndarray[Any, Any], ...]:
        """The staging buffer's views for a step of that shape (token ids, positions, block tables `[batch, width]`),
        reset to padding: token 0 at position -1 (padding queries), rows reading the trash block."""
        if self._copied is not None:
            self._copied.synchronize()
        ids, positions, tables = _views(self._staged, batch, queries, self.max_blocks)
        tables = tables[:, :width]
        ids[:] = 0
        positions[:] = -1
        tables[:] = self.cache.trash_block
        return ids, positions, tables

    def _upload(self, shape: tuple[int, int, int]) -> None:
        """Copies the staged inputs of a step of that shape to the device (nothing to copy on a CPU)."""
        if self._device is not self._host:
            batch, queries, _ = shape
            used = batch * (2 * queries + self.max_blocks)
            self._device[:used].copy_(self._host[:used], non_blocking=True)
            if self._copied is not None:
                self._copied.record()

    def _launch(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """Copies the staged step to the device and runs it: its graph's replay, else eagerly."""
        self._upload(shape)
        captured = self._captured.get(shape)
        if captured is None:
            return self._run(*shape)
        graph, logits = captured
        graph.replay()
        self.replays += 1
        return logits

    def read_in_place(self, directory: Path) -> bool:
        """Decode steps on a CPU from now on attend through the kernel that reads each row's K/V in place in the
        pool (`paged_decode_kernel.py`, built in `directory` or loaded from there); False where it cannot (another
        device or dtype, no compiler): attention then gathers the rows' K/V as before."""
        cache = self.cache
        if cache.device.type != "cpu" or cache.geometry.dtype != torch.float32:
            return False
        if not paged_decode_kernel.load(directory):
            return False
        self._in_place = True
        logger.info("decode attention reads each row's K/V in place in the pool (paged decode kernel)")
        return True

    def compile(self, store: Path | None = None, model_key: Sequence[str] = ()) -> None:
        """Decode steps from now on run compiled (`torch.compile`, inductor), with progress in the log: loaded from
        `store` where an earlier start left them (`step_store.py`; `model_key` names the model and its weights'
        layout), else compiled here on padding steps (minutes) and stored there.

        Batch size and width are symbolic, so one graph serves every step of two rows or more. The compiler
        specialises sizes of 1: a step of one row gets a graph of its own (padding it to two rows would slow the
        single stream), while widths are padded to at least two blocks (each graph costs a long compile)."""
        key = self._compile_key(model_key)
        started = time.monotonic()
        # Kept apart until both are made: the second graph's guards on `self` would take in the first (which cannot
        # be stored), and a later start, loading it, would not see this object as it was when it was compiled.
        steps = {}
        shapes = self._compiled_shapes()
        for done, shape in enumerate(shapes, 1):
            example = self._example(shape)
            dynamic = [(3, 1)] + ([(1, 0), (2, 0), (3, 0)] if shape[0] > 1 else [])
            path = None if store is None else self._stored_path(store, key, shape)
            steps[shape[0]], loaded = compiled_step(FixedSteps._device_step, example, dynamic, path)
            what = "loaded" if loaded else "compiled"
            logger.info("%s %d/%d decode step graphs (%.1f s)", what, done, len(shapes), time.monotonic() - started)
        self.install(steps)

    def stored(self, store: Path, model_key: Sequence[str] = ()) -> dict[int, Callable[..., torch.Tensor]] | None:
        """The compiled decode steps an earlier compile left in `store` for this model (`model_key`) and these
        sizes, loaded and their guards checked, nothing run (so off the thread that runs the steps, while it runs
        them eagerly, as long as this object is not yet stepping); None when one is missing or refused."""
        key = self._compile_key(model_key)
        steps = {}
        for shape in self._compiled_shapes():
            step = stored_step(FixedSteps._device_step, self._example(shape), self._stored_path(store, key, shape))
            if step is None:
                return None
            steps[shape[0]] = step
        return steps

    def has_stored(self, store: Path, model_key: Sequence[str] = ()) -> bool:
        """Whether `store` holds a file for every compiled decode step of this model and these sizes (unchecked)."""
        key = self._compile_key(model_key)
        return all(self._stored_path(store, key, shape).exists() for shape in self._compiled_shapes())

    def install(self, steps: dict[int, Callable[..., torch.Tensor]]) -> None:
        """Decode steps from now on run `steps` (one row: key 1; two rows or more: key 2), each run once here on
        padding rows first (lazy initialisations: a failure surfaces here, not in a request's step)."""
        for rows, step in steps.items():
            step(*self._example((rows, 1, self._least_width)))
        self._compiled = dict(steps)

    @property
    def compiled(self) -> bool:
        """Whether decode steps run compiled."""
        return bool(self._compiled)

    def _compile_key(self, model_key: Sequence[str]) -> str:
        """The store key of this object's compiled decode steps (and the width they are padded to, set here)."""
        register_compilable_op()
        self._least_width = min(2, self.max_blocks)
        sizes = f"rows {self.max_rows}, blocks {self.max_blocks} of {self.cache.block_size}, {self.cache.trash_block}"
        sizes += f", in place {self._in_place}"  # a graph calling the kernel needs it registered
        return store_key([*model_key, sizes])

    def _compiled_shapes(self) -> list[tuple[int, int, int]]:
        return [(rows, 1, self._least_width) for rows in (1, 2) if rows <= self.max_rows]

    def _example(self, shape: tuple[int, int, int]) -> tuple[Any, ...]:
        """The arguments of the compiled step of that shape, the staged rows all padding (they read and write the
        trash block)."""
        self._grid(*shape)
        return (self, *self._inputs(*shape))

    @staticmethod
    def _stored_path(store: Path, key: str, shape: tuple[int, int, int]) -> Path:
        return store / f"decode-{min(shape[0], 2)}-{key}.bin"  # 2: two rows or more

    def _inputs(self, batch: int, queries: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of the step of the first `batch` rows of the buffers, `queries` each, over `width` blocks."""
        ids, positions, tables = _views(self._device, batch, queries, self.max_blocks)
        return ids, positions, tables[:, :width]

    def _run(self, batch: int, queries: int, width: int) -> torch.Tensor:
        """The step of the first `batch` rows of the buffers, `queries` each, over `width` blocks: device work only."""
        inputs = self._inputs(batch, queries, width)
        compiled = self._compiled.get(min(batch, 2)) if queries == 1 else None
        return self._device_step(*inputs) if compiled is None else compiled(self, *inputs)

    def _device_step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """A step's device work from its inputs: token ids and positions `[batch, queries]` (position -1: a padding
        query), block tables `[batch, width]`."""
        batch, queries = ids.shape
        size, trash = self.cache.block_size, self.cache.trash_block
        columns = tables.shape[1] * size
        real = positions >= 0
        at = positions.clamp(min=0)  # padding queries: position 0 (they see their row's first column only)
        # Each query sees its row's columns up to its own position (its K/V is written before attention reads);
        # columns past the row's newest token read the zero block.
        written = tables.gather(1, torch.div(at, size, rounding_mode="floor")) * size + at % size
        write_slots = torch.where(real, written, trash * size).reshape(batch * queries)
        if queries == 1 and self._in_place:
            # Attention walks each row's table itself: transformers is handed a placeholder mask it passes on.
            placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)
            read = InPlaceDecode(tables.contiguous(), at[:, 0] + 1)  # once, not in every layer
            plan = StepPlan(batch, 1, columns, placeholder, at, write_slots, None, None, (), read)
            with self.cache.running(plan):
                return self._forward(ids, at, placeholder)
        seen = self._columns[:columns][None, None, :] <= at[:, :, None]
        newest = self._columns[:columns][None, :] <= at[:, -1:]
        slots = (tables[:, :, None] * size + self._offsets).reshape(batch, columns)
        gather = torch.where(newest, slots, NULL_BLOCK * size).reshape(batch * columns)
        mask = seen[:, None]
        plan = StepPlan(
            rows=batch,
            queries=queries,
            width=columns,
            mask=mask,
            positions=at,
            write_slots=write_slots,
            write_from=None,
            gather=None,
            groups=(AttentionGroup(None, columns, gather, mask),),
        )
        with self.cache.running(plan):
            return self._forward(ids, at, mask)


def _views(buffer: Any, batch: int, queries: int, max_blocks: int) -> tuple[Any, Any, Any]:
    """The staging layout of a step of `batch` rows of `queries` new tokens, over a tensor or an array: token ids
    `[batch, queries]`, positions `[batch, queries]`, block tables `[batch, max_blocks]`."""
    tokens = batch * queries
    return (
        buffer[:tokens].reshape(batch, queries),
        buffer[tokens : 2 * tokens].reshape(batch, queries),
        buffer[2 * tokens : 2 * tokens + batch * max_blocks].reshape(batch, max_blocks),
    )
