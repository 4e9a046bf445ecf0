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
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
# Rows' adapters whose grouping and mask are kept: a decode step's rows, unchanged from one step to the next.
_KEPT_STEPS = 8


@dataclass(frozen=True)
class StackedRows:
    """Several adapters in one forward: the adapters present (`present`), each given `rank` places side by side
    (its own rank, padded with zeros); `mask` `[rows, 1, adapters * rank]` keeps each row's adapter's places (none
    for a row without one) and `alpha` scales the second product. With one scaling shared by the adapters the mask
    holds ones and `alpha` is that scaling; else the mask holds each row's own scaling (float32) and `alpha` is 1.
    `layers`: each layer's pairs of `present` side by side, filled as the layers ask (shared by the steps holding
    the same adapters)."""

    present: tuple[LoraWeightsLike, ...]
    rank: int
    mask: torch.Tensor
    alpha: float
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Stacks:
    present: tuple[LoraWeightsLike, ...]
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Step:
    """A step's rows' adapters (held, so no id is reused while kept), grouped and stacked."""

    adapters: tuple[LoraWeightsLike | None, ...]
    groups: list[tuple[LoraWeightsLike, torch.Tensor]]
    stacked: StackedRows | None


class LoraRows:
    """The adapter of each row of the forward running now: `groups` (adapter, its rows' indices on the device), and
    with several adapters `stacked`; the pairs stacked per layer for the last sets of adapters, and the grouping of
    the last sets of rows (a decode step's rows mostly keep their adapters from one step to the next)."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoraWeightsLike, torch.Tensor]] = []
        self.stacked: StackedRows | None = None
        # Keyed by the adapters' ids; each entry holds its adapters, so no id is reused while it is kept.
        self._stacks: OrderedDict[tuple[int, ...], _Stacks] = OrderedDict()
        self._steps: OrderedDict[tuple[object, ...], _Step] = OrderedDict()

    @contextmanager
    def using(self, adapters: Sequence[LoraWeightsLike | None], device: torch.device) -> Iterator[None]:
        """Rows `i` of the forwards run inside get `adapters[i]`'s update (None: the base model alone)."""
        step = self._step(adapters, device)
        self.groups, self.stacked = step.groups, step.stacked
        try:
            yield
        finally:
            self.groups = []
            self.stacked = None

    def _step(self, adapters: Sequence[LoraWeightsLike | None], device: torch.device) -> _Step:
        """The rows' grouping and mask, kept for the last few sets of rows' adapters."""
        key = (device, *(0 if adapter is None else id(adapter) for adapter in adapters))
        step = self._steps.get(key)
        if step is not None:
            self._steps.move_to_end(key)
            return step
        groups = group_rows(adapters, device)
        present = [adapter for adapter, _ in groups]
        layers = self._layers(present) if len(present) > 1 else {}
        step = self._steps[key] = _Step(tuple(adapters), groups, stack_rows(adapters, present, device, layers))
        while len(self._steps) > _KEPT_STEPS:
            self._steps.popitem(last=False)
        return step

    def _layers(self, present: Sequence[LoraWeightsLike]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The stacked pairs of the adapters `present`, kept for the last few sets; a set dropped here is dropped
        from the kept steps too (so no more than `_KEPT_STACKS` sets are held)."""
        key = tuple(id(adapter) for adapter in present)
        kept = self._stacks.get(key)
        if kept is not None:
            self._stacks.move_to_end(key)
            return kept.layers
        kept = self._stacks[key] = _Stacks(tuple(present), {})
        while len(self._stacks) > _KEPT_STACKS:
            _, dropped = self._stacks.popitem(last=False)
            for step_key in [k for k, s in self._steps.items() if s.stacked and s.stacked.layers is dropped.layers]:
                del self._steps[step_key]
        return kept.layers

    def stacks(self, name: str, features: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `name`'s pairs of the adapters present side by side: `a` `[adapters * rank, in]`, `b` `[out, adapters
        * rank]`, zeros for an adapter that does not target the layer and where its rank is below the largest."""
        stacked = self.stacked
        assert stacked is not None
        pairs = stacked.layers.get(name)
        if pairs is None:
            pairs = stacked.layers[name] = _stack(name, features, stacked, like)
        return pairs


def rows_using(
    rows: LoraRows | None, adapters: Sequence[LoraWeightsLike | None], device: torch.device
) -> AbstractContextManager[None]:
    """A runner's forwards run inside apply `adapters[i]` to row `i` (`rows.using`); nothing to apply where the model
    serves no adapters (`rows` None)."""
    return nullcontext() if rows is None else rows.using(adapters, device)


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
    adapters: Sequence[LoraWeightsLike | None],
    present: Sequence[LoraWeightsLike],
    device: torch.device,
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> StackedRows | None:
    """Each row's part of the adapters `present` stacked, when there are several; None with one or none. `layers`:
    where the layers' stacked pairs of `present` are kept (a new dict if not given)."""
    if len(present) < 2:
        return None
    firsts = [next(iter(adapter.pairs.values())) for adapter in present]  # one rank and scaling an adapter
    rank = max(pair.a.shape[0] for pair in firsts)
    places = {id(adapter): i for i, adapter in enumerate(present)}
    scalings = [pair.scaling for pair in firsts]
    shared = len(set(scalings)) == 1
    # Differing scalings ride in the mask, in float32: the product is rounded to its dtype once, as with one scaling.
    mask = torch.zeros(len(adapters), 1, len(present) * rank, dtype=firsts[0].a.dtype if shared else torch.float32)
    for row, adapter in enumerate(adapters):
        if adapter is not None:
            place = places[id(adapter)]
            mask[row, 0, place * rank : (place + 1) * rank] = 1.0 if shared else scalings[place]
    layers = {} if layers is None else layers
    return StackedRows(tuple(present), rank, mask.to(device), scalings[0] if shared else 1.0, layers)


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


def _add_product(out: torch.Tensor, low: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """`out += low @ b.T * alpha` (`low` `[rows, ..., rank]`): written straight into `out` by one `addmm_` where
    `out` is contiguous and of `b`'s dtype, else added as a product cast to `out`'s dtype. Returns `out`."""
    if out.dtype == b.dtype and out.is_contiguous():
        out.view(-1, out.shape[-1]).addmm_(low.reshape(-1, low.shape[-1]), b.t(), alpha=alpha)
    else:
        out.add_((torch.nn.functional.linear(low, b) * alpha).to(out.dtype))
    return out


def add_stacked_lora(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: StackedRows
) -> torch.Tensor:
    """`out` (`[rows, ..., out]`) with row `i`'s update added, `x[i] @ a_i.T @ b_i.T * scaling` for its adapter's
    pair, from the pairs of all adapters present side by side (`a` `[adapters * rank, in]`, `b` `[out, adapters *
    rank]`): every row's low-rank product against all of them, then all but its own adapter's part masked to zero
    (and scaled, where scalings differ) before the second product, which adds into `out`. Each adapter's weights
    are read once a step. In place; returns `out`."""
    low = torch.nn.functional.linear(x.reshape(x.shape[0], -1, x.shape[-1]).to(a.dtype), a)
    low.mul_(rows.mask)
    return _add_product(out, low, b, rows.alpha)


def add_lora(out: torch.Tensor, x: torch.Tensor, groups: Sequence[tuple[torch.Tensor, LoraPair]]) -> torch.Tensor:
    """`out` (the base layer's output, `[rows, ..., out]`) with each group's update added to its rows: for the rows
    `index` of a group, `x[index] @ a.T @ b.T * scaling` (`x` `[rows, ..., in]`). A group of every row adds its
    second product straight into `out`; the others' updates go in by `index_add_`. In place; returns `out`."""
    for index, pair in groups:
        if index.shape[0] == x.shape[0]:  # indices are distinct: the group is the whole batch, in order
            _add_product(out, torch.nn.functional.linear(x.to(pair.a.dtype), pair.a), pair.b, pair.scaling)
            continue
        picked = x.index_select(0, index).to(pair.a.dtype)
        update = torch.nn.functional.linear(torch.nn.functional.linear(picked, pair.a), pair.b)
        if update.dtype == out.dtype:
            out.index_add_(0, index, update, alpha=pair.scaling)
        else:
            out.index_add_(0, index, (update * pair.scaling).to(out.dtype))
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
