"""A base model's linear layers with each row's LoRA update added: the base weights applied once to the whole batch,
then each row's adapter to that row only, never merged into the weights.

`LoraRows` says which adapter each row of the forward running now uses (the runner sets it before a forward);
every `LoraLinear` reads it, so the grouping is worked out once a step, not once a layer. With one adapter in the
step, its rows are gathered and take two matmuls (`add_lora`); with several, the pairs of the adapters present
side by side take two matmuls over all rows, each row's own part kept by a mask between them (`add_stacked_lora`):
a step costs the same few operations a layer however many adapters it holds (eager operations on small matrices
cost mostly their dispatch on a CPU), and reads each adapter's weights once. The side-by-side pairs are kept for the
last few sets of adapters seen together.
"""

from __future__ import annotations

from collections import OrderedDict
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


# Sets of adapters whose stacked pairs are kept (a decode step's set, a prefill's, ...).
_KEPT_STACKS = 4


@dataclass(frozen=True)
class StackedRows:
    """Several adapters in one forward: the adapters present (`present`), each given `rank` places side by side
    (its own rank, padded with zeros); `mask` `[rows, 1, adapters * rank]` keeps each row's adapter's places (none
    for a row without one); the scaling they share (None when they differ: `scales` `[rows, 1, 1]` float32, each
    row's own)."""

    present: tuple[LoraWeightsLike, ...]
    rank: int
    mask: torch.Tensor
    scaling: float | None
    scales: torch.Tensor | None


@dataclass(frozen=True)
class _Stacks:
    present: tuple[LoraWeightsLike, ...]
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoraRows:
    """The adapter of each row of the forward running now: `groups` (adapter, its rows' indices on the device), and
    with several adapters `stacked`; the pairs stacked per layer for the last sets of adapters."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoraWeightsLike, torch.Tensor]] = []
        self.stacked: StackedRows | None = None
        # Keyed by the adapters' ids; each entry holds its adapters, so no id is reused while it is kept.
        self._stacks: OrderedDict[tuple[int, ...], _Stacks] = OrderedDict()

    @contextmanager
    def using(self, adapters: Sequence[LoraWeightsLike | None], device: torch.device) -> Iterator[None]:
        """Rows `i` of the forwards run inside get `adapters[i]`'s update (None: the base model alone)."""
        self.groups = group_rows(adapters, device)
        self.stacked = stack_rows(adapters, [adapter for adapter, _ in self.groups], device)
        try:
            yield
        finally:
            self.groups = []
            self.stacked = None

    def stacks(self, name: str, features: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `name`'s pairs of the adapters present side by side: `a` `[adapters * rank, in]`, `b` `[out, adapters
        * rank]`, zeros for an adapter that does not target the layer and where its rank is below the largest."""
        stacked = self.stacked
        assert stacked is not None
        key = tuple(id(adapter) for adapter in stacked.present)
        kept = self._stacks.get(key)
        if kept is None:
            kept = self._stacks[key] = _Stacks(stacked.present, {})
            while len(self._stacks) > _KEPT_STACKS:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(key)
        layers = kept.layers
        if name not in layers:
            layers[name] = _stack(name, features, stacked, like)
        return layers[name]


def group_rows(
    adapters: Sequence[LoraWeightsLike | None], device: torch.device
) -> list[tuple[LoraWeightsLike, torch.Tensor]]:
    """Each adapter present with the indices of its rows, in order of first appearance; rows without one left out."""
    rows: dict[int, tuple[LoraWeightsLike, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            rows.setdefault(id(adapter), (adapter, []))[1].append(i)
    return [(adapter, torch.tensor(indices, device=device)) for adapter, indices in rows.values()]


def stack_rows(
    adapters: Sequence[LoraWeightsLike | None], present: Sequence[LoraWeightsLike], device: torch.device
) -> StackedRows | None:
    """Each row's part of the adapters `present` stacked, when there are several; None with one or none."""
    if len(present) < 2:
        return None
    firsts = [next(iter(adapter.pairs.values())) for adapter in present]  # one rank and scaling an adapter
    rank = max(pair.a.shape[0] for pair in firsts)
    places = {id(adapter): i for i, adapter in enumerate(present)}
    mask = torch.zeros(len(adapters), 1, len(present) * rank, dtype=firsts[0].a.dtype)
    for row, adapter in enumerate(adapters):
        if adapter is not None:
            place = places[id(adapter)] * rank
            mask[row, 0, place : place + rank] = 1
    scalings = [pair.scaling for pair in firsts]
    if len(set(scalings)) == 1:
        return StackedRows(tuple(present), rank, mask.to(device), scalings[0], None)
    per_row = [0.0 if adapter is None else scalings[places[id(adapter)]] for adapter in adapters]
    scales = torch.tensor(per_row, dtype=torch.float32, device=device)[:, None, None]
    return StackedRows(tuple(present), rank, mask.to(device), None, scales)


def _stack(
    name: str, features: tuple[int, int], rows: StackedRows, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    in_features, out_features = features
    rank = rows.rank
    a = like.new_zeros(len(rows.present) * rank, in_features)
    b = like.new_zeros(out_features, len(rows.present) * rank)
    for i, adapter in enumerate(rows.present):
        pair = adapter.pairs.get(name)
        if pair is not None:
            a[i * rank : i * rank + pair.a.shape[0]] = pair.a
            b[:, i * rank : i * rank + pair.b.shape[1]] = pair.b
    return a, b


def add_stacked_lora(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: StackedRows
) -> torch.Tensor:
    """`out` (`[rows, ..., out]`) with row `i`'s update added, `x[i] @ a_i.T @ b_i.T * scaling` for its adapter's
    pair, from the pairs of all adapters present side by side (`a` `[adapters * rank, in]`, `b` `[out, adapters *
    rank]`): every row's low-rank product against all of them, then all but its own adapter's part masked to zero
    before the second product. Each adapter's weights are read once a step. In place; returns `out`."""
    flat = x.reshape(x.shape[0], -1, x.shape[-1]).to(a.dtype)
    low = torch.nn.functional.linear(flat, a)
    low.mul_(rows.mask)
    update = torch.nn.functional.linear(low, b)
    update.mul_(rows.scales if rows.scales is not None else rows.scaling or 0.0)
    out.add_(update.view(out.shape).to(out.dtype))
    return out


def add_lora(out: torch.Tensor, x: torch.Tensor, groups: Sequence[tuple[torch.Tensor, LoraPair]]) -> torch.Tensor:
    """`out` (the base layer's output, `[rows, ..., out]`) with each group's update added to its rows: for the rows
    `index` of a group, `x[index] @ a.T @ b.T * scaling` (`x` `[rows, ..., in]`). In place; returns `out`."""
    for index, pair in groups:
        every_row = index.shape[0] == x.shape[0]  # indices are distinct: the group is the whole batch, in order
        picked = (x if every_row else x.index_select(0, index)).to(pair.a.dtype)
        update = torch.nn.functional.linear(torch.nn.functional.linear(picked, pair.a), pair.b) * pair.scaling
        if every_row:
            out.add_(update.to(out.dtype))
        else:
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
        rows = self._rows
        groups = rows.groups
        if not groups:
            return out
        if rows.stacked is not None:
            a, b = rows.stacks(self.lora_name, (self.in_features, self.out_features), out)
            return add_stacked_lora(out, x, a, b, rows.stacked)
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
