"""Per-row cross-attention K/V of encoder-decoder models, padded to the batch's longest encoder input."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from transformers_openai.runners.kv.kv_cache import OwnedLayer, RowSelection


class _CrossLayer(OwnedLayer):  # type: ignore[no-untyped-call]
    """Exposes the batch's cross K/V as `keys`/`values`, which is where T5-style attention reads them."""

    @property
    def keys(self) -> torch.Tensor:
        keys = self._owner.view(self._owner.k, self._index)
        return keys.transpose(-1, -2) if self._owner.keys_transposed else keys  # type: ignore[no-any-return]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        pass  # the base class assigns None at construction; the buffers live in the owner

    @property
    def values(self) -> torch.Tensor:
        return self._owner.view(self._owner.v, self._index)  # type: ignore[no-any-return]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("cross-attention K/V are written at admission, never during a batched step")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self._owner.width), 0

    def get_seq_length(self) -> int:
        return int(self._owner.width)


class CrossKVCache(Cache, RowSelection):
    """Buffers `[max_rows, heads, max_len, head_dim]` per layer, rows left-aligned, zero beyond each row's length.
    After `transpose_keys` the keys are kept `[max_rows, heads, head_dim, max_len]` (for the kernel of
    `cross_attention.py`, whose scores are then passes over contiguous positions; sdpa reads such keys 4-40x slower),
    and `keys` shows them the usual way round, as a view.

    A row is appended at the end and the last row moves into the hole of a row that leaves. The buffers are
    allocated once, at the first row, and never grow (their size is set aside from the K/V budget); on a CPU the
    rows never used take no memory.
    """

    def __init__(self, num_layers: int, max_rows: int, max_len: int) -> None:
        self._layers_n = num_layers
        self.max_rows = max_rows
        self.max_len = max_len
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens: list[int] = []
        self.keys_transposed = False
        super().__init__(layers=[_CrossLayer(self, i) for i in range(num_layers)])

    def transpose_keys(self) -> None:
        """Keeps the keys transposed from now on; only while no row is held."""
        if self.rows:
            raise RuntimeError("the keys' layout changes only while no row is held")
        self.keys_transposed = True
        self.k, self.v = [], []  # allocated again, in the new layout, at the next row

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        """Columns the batch attends over: the longest encoder input among the rows."""
        return max(self.lens, default=0)

    def view(self, buffers: list[torch.Tensor], layer: int) -> torch.Tensor:
        """The step's rows of one layer's buffer, to the batch's width (the last dimension of the keys)."""
        rows = buffers[layer][self.active_rows(self.rows, buffers[layer].device)]
        return rows[..., : self.width] if buffers is self.k and self.keys_transposed else rows[:, :, : self.width]

    def encoder_mask(self) -> torch.Tensor:
        device = self.k[0].device
        columns = torch.arange(self.width, device=device).unsqueeze(0)
        return (columns < torch.tensor(self.active_lens, device=device).unsqueeze(1)).long()

    def insert(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        length = layers[0][0].shape[-2]
        if length > self.max_len:
            raise ValueError(f"an encoder output of {length} positions; rows hold {self.max_len}")
        if self.rows >= self.max_rows:
            raise RuntimeError("no free cross-attention row")
        if not self.k:
            self._allocate(layers[0][0])
        pos = self.rows
        for layer, (key, value) in enumerate(layers):
            self.k[layer][pos].zero_()
            if self.keys_transposed:
                self.k[layer][pos, ..., :length] = key[0].transpose(-1, -2)
            else:
                self.k[layer][pos, :, :length] = key[0]
            self.v[layer][pos].zero_()
            self.v[layer][pos, :, :length] = value[0]
        self.lens.append(length)
        return pos

    def remove(self, pos: int) -> int | None:
        """Frees the row at `pos`. Returns the old position of the row moved into its place, if any."""
        last = self.rows - 1
        moved = None
        if pos != last:
            moved = last
            for buffers in (self.k, self.v):
                for buf in buffers:
                    buf[pos] = buf[last]
            self.lens[pos] = self.lens[last]
        self.lens.pop()
        return moved

    def _allocate(self, like: torch.Tensor) -> None:
        rows, heads, dim = self.max_rows, like.shape[1], like.shape[3]
        key_shape = (rows, heads, dim, self.max_len) if self.keys_transposed else (rows, heads, self.max_len, dim)
        self.k = [like.new_empty(key_shape) for _ in range(self._layers_n)]
        self.v = [like.new_empty(rows, heads, self.max_len, dim) for _ in range(self._layers_n)]
