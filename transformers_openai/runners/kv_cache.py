"""A batched KV cache with preallocated rows, usable by stock transformers forwards as a `Cache`.

Rows are right-aligned (left-padded): the causal-mask code of transformers uses one shared offset
for the whole batch, so every row's newest token sits in the same column. Each row's real length
is kept apart and turned into the attention mask and position ids by the runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def layer_tensors(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) of every layer of a filled single-request cache."""
    tensors = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError(f"unsupported cache layer {type(layer).__name__}: attention K/V expected")
        tensors.append((keys, values))
    return tensors


class OwnedLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """A cache layer whose tensors live in a batched owner cache; transformers only sees this per-layer view."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: Any, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self._index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def get_max_length(self) -> int:
        return -1


class _SlotLayer(OwnedLayer):  # type: ignore[no-untyped-call]
    """Writes the step's new column in place, no concatenation."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._owner.write(self._index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return int(self._owner.length)


class RowSelection:
    """Lets a step run over some rows only, to probe them after a failed batched step.

    A probe writes only the uncommitted next column and never advances the cache: the next real
    step overwrites what it wrote, so probing leaves every row as it was.
    """

    lens: list[int]
    _selected: list[int] | None = None  # row positions a probe step runs over; None: every row

    @contextmanager
    def selecting(self, positions: list[int]) -> Iterator[None]:
        self._selected = positions
        try:
            yield
        finally:
            self._selected = None

    @property
    def active_lens(self) -> list[int]:
        """The lengths of the rows the next step runs over."""
        if self._selected is None:
            return self.lens
        return [self.lens[pos] for pos in self._selected]

    def active_rows(self, rows: int, device: torch.device) -> slice | torch.Tensor:
        """An index over the first dimension of the buffers: the rows the next step runs over."""
        if self._selected is None:
            return slice(0, rows)
        return torch.tensor(self._selected, device=device)


def zero_buffers(like: torch.Tensor, layers: int, rows: int, capacity: int) -> list[torch.Tensor]:
    """One `[rows, heads, capacity, head_dim]` zero buffer per layer, shaped and typed like `like`."""
    shape = (rows, like.shape[1], capacity, like.shape[3])
    return [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]


def grow_columns(buffers: list[torch.Tensor], capacity: int, keep: int) -> None:
    """Replaces each buffer by one with `capacity` columns, keeping the first `keep` (zeros elsewhere)."""
    for layer, old in enumerate(buffers):
        grown = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
        grown[:, :, :keep] = old[:, :, :keep]
        buffers[layer] = grown


class BatchKVCache(Cache, RowSelection):
    """K/V buffers `[max_rows, kv_heads, capacity, head_dim]` per layer; rows 0..rows-1 are in use.

    Joining writes a prefilled row into the next free position; leaving moves the last row into the
    hole. Capacity doubles as sequences grow and the buffers are dropped when the batch empties, so
    memory follows the live requests, not the number served.
    """

    def __init__(self, num_layers: int, max_rows: int, max_len: int) -> None:
        self._layers_n = num_layers
        self.max_rows = max_rows
        self.max_len = max_len
        self.rows = 0
        self.length = 0  # shared column count; row i holds its tokens in the last lens[i] columns
        self.lens: list[int] = []
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])

    # -- the Cache side, called by the model's attention layers during a decode step
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = key.shape[-2]
        end = self.length + n
        rows = self.active_rows(self.rows, key.device)
        self._k[layer][rows, :, self.length : end] = key
        self._v[layer][rows, :, self.length : end] = value
        return self._k[layer][rows, :, :end], self._v[layer][rows, :, :end]


    def advance(self, n: int = 1) -> None:
        """Records that the step just run appended `n` columns to every row."""
        self.length += n
        self.lens = [length + n for length in self.lens]

    def ensure_room(self, n: int) -> None:
        """Makes sure `n` more columns fit before a step writes them."""
        self._reserve(self.length + n)

    # -- row management, called by the runner between steps
    def insert(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Adds a row from a single-request cache (`[1, heads, len, dim]` per layer); returns its position."""
        if self.rows >= self.max_rows:
            raise RuntimeError("no free KV row")
        new_len = layers[0][0].shape[-2]
        if not self._k:
            self._allocate(layers[0][0], capacity=max(new_len + 1, 16))
        if new_len > self.length:
            self._shift_right(new_len - self.length)
        self._reserve(self.length + 1)
        pos = self.rows
        start = self.length - new_len
        for layer, (key, value) in enumerate(layers):
            self._k[layer][pos, :, :start] = 0
            self._v[layer][pos, :, :start] = 0
            self._k[layer][pos, :, start : self.length] = key[0]
            self._v[layer][pos, :, start : self.length] = value[0]
        self.rows += 1
        self.lens.append(new_len)
        return pos

    def remove(self, pos: int) -> int | None:
        """Frees the row at `pos`. Returns the old position of the row moved into its place, if any."""
        last = self.rows - 1
        moved = None
        if pos != last:
            for layer in range(self._layers_n):
                self._k[layer][pos, :, : self.length] = self._k[layer][last, :, : self.length]
                self._v[layer][pos, :, : self.length] = self._v[layer][last, :, : self.length]
            self.lens[pos] = self.lens[last]
            moved = last
        self.lens.pop()
        self.rows -= 1
        if self.rows == 0:
            self._k, self._v, self.length = [], [], 0
        else:
            self._trim()
        return moved

    def attention_mask(self, extra: int) -> torch.Tensor:
        """`[rows, length + extra]` mask: 1 on each row's real tokens and on the `extra` new ones."""
        device = self._k[0].device
        columns = torch.arange(self.length + extra, device=device).unsqueeze(0)
        starts = torch.tensor([self.length - n for n in self.active_lens], device=device).unsqueeze(1)
        return (columns >= starts).long()

    # -- buffer housekeeping
    def _allocate(self, like: torch.Tensor, capacity: int) -> None:
        self._k = zero_buffers(like, self._layers_n, self.max_rows, capacity)
        self._v = zero_buffers(like, self._layers_n, self.max_rows, capacity)

    def _reserve(self, needed: int) -> None:
        capacity = self._k[0].shape[2]
        if needed <= capacity:
            return
        new_capacity = min(max(needed, capacity * 2), max(self.max_len + 1, needed))
        grow_columns(self._k, new_capacity, keep=self.length)
        grow_columns(self._v, new_capacity, keep=self.length)

    def _shift_right(self, by: int) -> None:
        self._reserve(self.length + by + 1)
        for buffers in (self._k, self._v):
            for buf in buffers:
                if self.rows:
                    buf[: self.rows, :, by : by + self.length] = buf[: self.rows, :, : self.length].clone()
                    buf[: self.rows, :, :by] = 0
        self.length += by

    def _trim(self) -> None:
        """Drops leading columns that are padding in every row (after the longest row left)."""
        by = self.length - max(self.lens)
        if by <= 0:
            return
        new_length = self.length - by
        for buffers in (self._k, self._v):
            for buf in buffers:
                buf[: self.rows, :, :new_length] = buf[: self.rows, :, by : self.length].clone()
        self.length = new_length
