"""Self-attention K/V of every row in one pool of fixed-size blocks per layer, seen by transformers as a `Cache`.

A step runs some rows, each adding its own number of new tokens (a prompt chunk, or one decode token). Before the
forward, `plan` turns the rows' block tables into index tensors once; in the forward every layer then writes its
new K/V into the rows' slots and reads each row back right-aligned (the newest token of every row in the last
column, padding columns on the left reading the zero block), which is the layout transformers' causal-mask code
expects from a left-padded batch. Memory follows the rows' own lengths; only the one layer being computed is
padded to the longest row of the step, and that in one scratch buffer reused by every layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from transformers_openai.runners.block_pool import NULL_BLOCK, BlockTable
from transformers_openai.runners.kv_cache import OwnedLayer


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's self-attention K/V."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class StepPlan:
    """Index tensors of one step over `rows` rows: `queries` new positions per row (right-aligned), `width` columns.

    `mask` `[rows, width]` is 1 on each row's real columns; `positions` `[rows, queries]` are the new tokens' position
    ids (0 on padding); `write_slots` are the pool slots of the new tokens in row order, taken from the flattened
    query grid at `write_from` (None when no row is padded); `gather` is the pool slot of every column.
    """

    rows: int
    queries: int
    width: int
    mask: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    write_from: torch.Tensor | None
    gather: torch.Tensor


class _PagedLayer(OwnedLayer):  # type: ignore[no-untyped-call]
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._owner.write(self._index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.past + query_length, 0

    def get_seq_length(self) -> int:
        return int(self._owner.past)


class PagedKVCache(Cache):
    """The pool tensors `[heads, blocks x block_size, head_dim]` per layer and the step being run over them.

    Heads first: a row read back is `[heads, width, head_dim]` with each head's columns contiguous, as attention
    kernels read them.
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.geometry = geometry
        self.block_size = block_size
        self.device = device
        shape = (geometry.heads, num_blocks * block_size, geometry.head_dim)
        # Untouched pages of an `empty` CPU tensor take no memory: the process grows as blocks are first used.
        self._k = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        self._v = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        null = slice(NULL_BLOCK * block_size, (NULL_BLOCK + 1) * block_size)
        for pool in (*self._k, *self._v):
            pool[:, null] = 0  # padding columns read these: finite, so masked-out weights stay exact zeros
        self._plan: StepPlan | None = None
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.past = 0  # columns before the step's new ones (what transformers reads as the cache's length)
        super().__init__(layers=[_PagedLayer(self, i) for i in range(geometry.layers)])

    def plan(self, rows: Sequence[tuple[BlockTable, int]]) -> StepPlan:
        """Index tensors for a step adding `n` tokens after each table's `length` (the tables hold their blocks)."""
        size = self.block_size
        new = torch.tensor([n for _, n in rows])
        lengths = torch.tensor([table.length for table, _ in rows])
        total = lengths + new
        queries, width = int(new.max()), int(total.max())
        most_blocks = max(len(table.blocks) for table, _ in rows)
        blocks = torch.full((len(rows), most_blocks), NULL_BLOCK, dtype=torch.long)
        for i, (table, _) in enumerate(rows):
            blocks[i, : len(table.blocks)] = torch.tensor(table.blocks)

        def slots(token: torch.Tensor) -> torch.Tensor:
            """Pool slots of token positions `[rows, k]`; negative positions read the zero block."""
            real = token >= 0
            token = token.clamp(min=0)
            found = blocks.gather(1, torch.div(token, size, rounding_mode="floor")) * size + token % size
            return torch.where(real, found, NULL_BLOCK * size)

        columns = torch.arange(width)
        gather = slots(columns[None, :] - (width - total[:, None]))
        step = torch.arange(queries)[None, :] - (queries - new[:, None])  # query j's place among the row's new
        fresh = step >= 0
        write_slots = slots(lengths[:, None] + step)[fresh]
        write_from = None if bool(fresh.all()) else fresh.flatten().nonzero()[:, 0]
        device = self.device
        return StepPlan(
            rows=len(rows),
            queries=queries,
            width=width,
            mask=(columns[None, :] >= (width - total[:, None])).long().to(device),
            positions=(lengths[:, None] + step).clamp(min=0).to(device),
            write_slots=write_slots.to(device),
            write_from=None if write_from is None else write_from.to(device),
            gather=gather.flatten().to(device),
        )

    @contextmanager
    def running(self, plan: StepPlan) -> Iterator[None]:
        """The forward run inside reads and writes through `plan`."""
        self._plan, self.past = plan, plan.width - plan.queries
        try:
            yield
        finally:
            self._plan, self._scratch, self.past = None, None, 0

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan
        if plan is None:
            raise RuntimeError("the paged K/V cache was used outside a planned step")
        heads, dim = key.shape[1], key.shape[3]
        scratch = self._scratch
        if scratch is None or scratch[0].dtype != key.dtype:
            shape = (heads, plan.rows * plan.width, dim)
            scratch = self._scratch = (key.new_empty(shape), key.new_empty(shape))
        read = []
        for pool, new, out in ((self._k[layer], key, scratch[0]), (self._v[layer], value, scratch[1])):
            flat = new.transpose(0, 1).reshape(heads, plan.rows * plan.queries, dim)
            if plan.write_from is not None:
                flat = flat.index_select(1, plan.write_from)
            pool.index_copy_(1, plan.write_slots, flat)
            torch.index_select(pool, 1, plan.gather, out=out)
            read.append(out.view(heads, plan.rows, plan.width, dim).transpose(0, 1))
        return read[0], read[1]

    def copy_in(self, table: BlockTable, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        """Writes a single-request cache's K/V (`[1, heads, len, dim]` per layer) at `start..` of `table`."""
        length = layers[0][0].shape[-2]
        positions = torch.arange(start, start + length)
        blocks = torch.tensor(table.blocks)
        slots = (blocks[positions // self.block_size] * self.block_size + positions % self.block_size).to(self.device)
        for layer, (key, value) in enumerate(layers):
            self._k[layer].index_copy_(1, slots, key[0])
            self._v[layer].index_copy_(1, slots, value[0])

    def copy_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copies the K/V at pool slots `source` to slots `target`, in every layer."""
        for pool in (*self._k, *self._v):
            pool.index_copy_(1, target, pool.index_select(1, source))
