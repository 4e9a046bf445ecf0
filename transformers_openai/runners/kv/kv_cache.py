"""Pieces shared by the batched caches that stock transformers forwards see as a `Cache`."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword `module.forward` takes its K/V cache by: `cache` from transformers 5.24 on (which still takes
    `past_key_values`, with a warning, until 5.40), `past_key_values` before it."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


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
