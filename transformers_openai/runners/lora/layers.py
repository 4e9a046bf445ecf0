"""A base model's linear layers with each row's LoRA update added: the base weights applied once to the whole batch,
then each adapter present in the step applied to its own rows only (grouped low-rank products), never merged.

`LoraRows` says which adapter each row of the forward running now uses (the runner sets it before a forward);
every `LoraLinear` reads it, so the grouping is worked out once a step, not once a layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

# The linear layers an adapter may target: those inside the decoder's repeated blocks (attention and MLP), as PEFT
# names them by their last part (`q_proj`, `down_proj`, ...). Embeddings and the output head are left alone.
_BLOCK_MARKERS = (".layers.", ".h.", ".blocks.", ".block.")


@dataclass(frozen=True)
class LoraPair:
    """One layer's low-rank update: `x @ a.T @ b.T * scaling` (`a` `[rank, in]`, `b` `[out, rank]`)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


class LoraWeightsLike(Protocol):
    """What a layer needs of an adapter: its pair for a layer name, if it targets that layer."""

    @property
    def pairs(self) -> dict[str, LoraPair]: ...


class LoraRows:
    """The adapter of each row of the forward running now, grouped: (adapter, its rows' indices on the device)."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoraWeightsLike, torch.Tensor]] = []

    @contextmanager
    def using(self, adapters: Sequence[LoraWeightsLike | None], device: torch.device) -> Iterator[None]:
        """Rows `i` of the forwards run inside get `adapters[i]`'s update (None: the base model alone)."""
        self.groups = group_rows(adapters, device)
        try:
            yield
        finally:
            self.groups = []


def group_rows(
    adapters: Sequence[LoraWeightsLike | None], device: torch.device
) -> list[tuple[LoraWeightsLike, torch.Tensor]]:
    """Each adapter present with the indices of its rows, in order of first appearance; rows without one left out."""
    rows: dict[int, tuple[LoraWeightsLike, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            rows.setdefault(id(adapter), (adapter, []))[1].append(i)
    return [(adapter, torch.tensor(indices, device=device)) for adapter, indices in rows.values()]


def add_lora(out: torch.Tensor, x: torch.Tensor, groups: Sequence[tuple[torch.Tensor, LoraPair]]) -> torch.Tensor:
    """`out` (the base layer's output, `[rows, ..., out]`) with each group's update added to its rows: for the rows
    `index` of a group, `x[index] @ a.T @ b.T * scaling` (`x` `[rows, ..., in]`). In place; returns `out`."""
    for index, pair in groups:
        picked = x.index_select(0, index).to(pair.a.dtype)
        update = torch.nn.functional.linear(torch.nn.functional.linear(picked, pair.a), pair.b) * pair.scaling
        out.index_add_(0, index, update.to(out.dtype))
    return out


class LoraLinear(torch.nn.Module):
    """A linear layer (plain, oneDNN-packed or quantized: any module mapping `[..., in]` to `[..., out]`) whose rows
    also get their adapter's update for this layer, as `rows` groups them."""

    def __init__(self, base: torch.nn.Module, name: str, in_features: int, out_features: int, rows: LoraRows) -> None:
        super().__init__()
        self.base = base
        self.lora_name = name
        self.in_features = in_features
        self.out_features = out_features
        self._rows = rows

    @property
    def weight(self) -> torch.Tensor:
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        groups = self._rows.groups
        if not groups:
            return out
        pairs = [(index, adapter.pairs[self.lora_name]) for adapter, index in groups if self.lora_name in adapter.pairs]
        return add_lora(out, x, pairs) if pairs else out


def _features(module: torch.nn.Module) -> tuple[int, int] | None:
    """A linear layer's (in, out) features, or None for a module that is not one."""
    in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(in_features, int) and isinstance(out_features, int):
        return in_features, out_features
    return None


def wrap_linear_layers(model: torch.nn.Module) -> tuple[LoraRows, dict[str, tuple[int, int]]]:
    """Wraps every linear layer inside the model's repeated blocks in a `LoraLinear` sharing one `LoraRows`; returns
    it and each wrapped layer's (in, out) features by its name in the model (what an adapter may target)."""
    rows = LoraRows()
    shapes: dict[str, tuple[int, int]] = {}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if any(marker in f".{name}" for marker in _BLOCK_MARKERS)
        and _features(module) is not None
        and not list(module.children())
    ]
    for name, module in targets:
        features = _features(module)
        assert features is not None
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoraLinear(module, name, *features, rows))
        shapes[name] = features
    return rows, shapes
