"""Self-attention K/V of every row in one pool of fixed-size blocks per layer, seen by transformers as a `Cache`.

A step runs some rows, each adding its own number of new tokens (a prompt chunk, or one decode token). Before the
forward, `plan` turns the rows' block tables into index tensors once; in the forward every layer then writes its
new K/V into the rows' slots. Attention then reads them in one of two ways:

- grouped (`paged_attention`, for models with plain causal attention): rows of similar lengths form groups, and
  each group's attention gathers only its own columns (`attend`);
- padded (any other attention): every row is read back right-aligned to the step's longest row (the newest token
  of every row in the last column, padding columns on the left reading the zero block), the layout transformers'
  mask code expects from a left-padded batch, in one scratch buffer reused by every layer.

Memory held between steps follows the rows' own lengths either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from transformers_openai.runners.kernels.paged_decode_kernel import attention as attention_in_place
from transformers_openai.runners.kv.block_table import NULL_BLOCK, BlockTable
from transformers_openai.runners.kv.kv_cache import OwnedLayer
from transformers_openai.runners.prefill_groups import length_groups


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
class AttentionGroup:
    """Rows of a step whose attention runs together over `width` columns, each row right-aligned.

    `rows`: their places in the step (None: all rows, in order); `gather` `[rows x width]`: the pool slot of every
    column; `mask` `[rows, 1, queries, width]`: which columns each query sees (None: all of them).
    """

    rows: torch.Tensor | None
    width: int
    gather: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class InPlaceDecode:
    """A decode step whose attention reads each row's K/V in place (`paged_decode_kernel.py`): the rows' block
    tables `[rows, width]` and how many tokens each attends to (its newest included). With `per_query`, any step:
    each query one of these rows (`[rows x queries, width]`, row-major)."""

    tables: torch.Tensor
    lengths: torch.Tensor


@dataclass(frozen=True)
class StepPlan:
    """Index tensors of one step over `rows` rows: `queries` new positions per row (right-aligned), `width` columns.

    `mask` `[rows, width]` is 1 on each row's real columns; `positions` `[rows, queries]` are the new tokens' position
    ids (0 on padding); `write_slots` are the pool slots of the new tokens in row order, taken from the flattened
    query grid at `write_from` (None when no row is padded). Padded reading uses `gather`, the pool slot of every
    column; grouped attention uses `groups`, or `in_place` for a decode step read in place.
    """

    rows: int
    queries: int
    width: int
    mask: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    write_from: torch.Tensor | None
    gather: torch.Tensor | None
    groups: tuple[AttentionGroup, ...] = ()
    in_place: InPlaceDecode | None = None


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
    kernels read them. `group_padding` set: attention is grouped (`attend`), groups padded by at most that share of
    their real columns; None: rows are read back padded.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        group_padding: float | None = None,
    ) -> None:
        self.geometry = geometry
        self.block_size = block_size
        self.device = device
        self.group_padding = group_padding
        # One block beyond the pool's: the trash block that padding rows of fixed-shape steps write and read.
        self.trash_block = num_blocks
        shape = (geometry.heads, (num_blocks + 1) * block_size, geometry.head_dim)
        # Untouched pages of an `empty` CPU tensor take no memory: the process grows as blocks are first used.
        self._k = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        self._v = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        null = slice(NULL_BLOCK * block_size, (NULL_BLOCK + 1) * block_size)
        trash = slice(num_blocks * block_size, (num_blocks + 1) * block_size)
        for pool in (*self._k, *self._v):
            pool[:, null] = 0  # padding columns read these: finite, so masked-out weights stay exact zeros
            pool[:, trash] = 0
        # Every query of every step attends alone through the in-place kernel (`paged_decode_kernel.py`, which must
        # be loaded), prompts' included: its result then depends on its own row's K/V only, not on the step's other
        # rows, widths or queries (`CausalLMRunner.attend_per_query`).
        self.per_query = False
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
        # One tensor from padded lists: a tensor per row costs host time on every step, for every row.
        padding = [NULL_BLOCK] * most_blocks
        blocks = torch.tensor([table.blocks + padding[len(table.blocks) :] for table, _ in rows], dtype=torch.long)

        def slots(token: torch.Tensor, held: torch.Tensor = blocks) -> torch.Tensor:
            """Pool slots of token positions `[rows, k]` of rows holding `held`; negative positions read the zero
            block."""
            real = token >= 0
            token = token.clamp(min=0)
            found = held.gather(1, torch.div(token, size, rounding_mode="floor")) * size + token % size
            return torch.where(real, found, NULL_BLOCK * size)

        columns = torch.arange(width)
        step = torch.arange(queries)[None, :] - (queries - new[:, None])  # query j's place among the row's new
        fresh = step >= 0
        write_slots = slots(lengths[:, None] + step)[fresh]
        write_from = None if bool(fresh.all()) else fresh.flatten().nonzero()[:, 0]
        device = self.device
        gather: torch.Tensor | None = None
        groups: tuple[AttentionGroup, ...] = ()
        in_place: InPlaceDecode | None = None
        if self.per_query:  # each query a row of its own, seeing its row's tokens up to itself (padding: token 0)
            seen = (lengths[:, None] + step + 1).clamp(min=1).flatten()
            in_place = InPlaceDecode(blocks.repeat_interleave(queries, dim=0).to(device), seen.to(device))
        elif self.group_padding is None:
            gather = slots(columns[None, :] - (width - total[:, None])).flatten().to(device)
        else:
            groups = tuple(
                self._group(torch.tensor(members), total, queries, slots, blocks)
                for members in length_groups(total.tolist(), self.group_padding)
            )
        return StepPlan(
            rows=len(rows),
            queries=queries,
            width=width,
            mask=(columns[None, :] >= (width - total[:, None])).long().to(device),
            positions=(lengths[:, None] + step).clamp(min=0).to(device),
            write_slots=write_slots.to(device),
            write_from=None if write_from is None else write_from.to(device),
            gather=gather,
            groups=groups,
            in_place=in_place,
        )

    def _group(self, members: torch.Tensor, total: torch.Tensor, queries: int, slots, blocks) -> AttentionGroup:  # type: ignore[no-untyped-def]
        """The attention group of rows `members` (of the step's rows with `total` tokens each after the step)."""
        total = total[members]
        width = int(total.max())
        position = torch.arange(width)[None, :] - (width - total[:, None])  # each column's token position
        gather = slots(position, blocks[members]).flatten().to(self.device)
        mask = None
        if queries > 1 or bool((total != width).any()):
            # Query j is token `total - queries + j`; it sees the row's tokens up to itself. Padding queries (a row
            # with fewer new tokens than the step's most) see up to token 0 at least, so no row of scores is empty.
            last_seen = (total[:, None] - queries + torch.arange(queries)[None, :]).clamp(min=0)
            visible = (position[:, None, :] >= 0) & (position[:, None, :] <= last_seen[:, :, None])
            mask = visible[:, None].to(self.device)
        everyone = len(members) == len(blocks) and bool((members == torch.arange(len(blocks))).all())
        return AttentionGroup(None if everyone else members.to(self.device), width, gather, mask)

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
        if plan.gather is None:  # grouped attention reads the pool itself
            for pool, new in ((self._k[layer], key), (self._v[layer], value)):
                flat = new.transpose(0, 1).reshape(heads, plan.rows * plan.queries, dim)
                if plan.write_from is not None:
                    flat = flat.index_select(1, plan.write_from)
                pool.index_copy_(1, plan.write_slots, flat)
            return key, value
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

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the step's queries `[rows, heads, queries, dim]` over layer `layer`'s pool, group by group;
        returns `[rows, queries, heads, dim]` (what transformers' attention functions return)."""
        plan = self._plan
        if plan is None or plan.gather is not None:
            raise RuntimeError("grouped attention outside a step planned for it")
        keys, values = self._k[layer], self._v[layer]
        heads, dim = keys.shape[0], keys.shape[2]
        if plan.in_place is not None:
            scale = dim**-0.5 if scaling is None else scaling
            rows, queries = query.shape[0], query.shape[2]
            if queries > 1:  # `per_query`: a prompt's queries as rows of one token each
                query = query.transpose(1, 2).reshape(rows * queries, query.shape[1], 1, dim)
            read = attention_in_place(
                query, keys, values, plan.in_place.tables, plan.in_place.lengths, self.block_size, scale
            )
            return read.transpose(1, 2) if queries == 1 else read.view(rows, queries, -1, dim)
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        for group in plan.groups:
            rows = group.gather.numel() // group.width
            k = keys.index_select(1, group.gather).view(heads, rows, group.width, dim).transpose(0, 1)
            v = values.index_select(1, group.gather).view(heads, rows, group.width, dim).transpose(0, 1)
            q = query if group.rows is None else query.index_select(0, group.rows)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=q.shape[1] != heads
            ).transpose(1, 2)
            if group.rows is None:
                out.copy_(attended)
            else:
                out.index_copy_(0, group.rows, attended)
        return out

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
