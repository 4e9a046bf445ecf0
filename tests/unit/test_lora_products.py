"""The LoRA products that add straight into the base layer's output (`addmm_`, `index_add_` with the scaling as
`alpha`, scalings folded into the stacked mask) equal the plain per-row reference `x @ a.T @ b.T * scaling`, and
the grouping kept from one step to the next gives each row its own adapter when the rows change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from transformers_openai.runners.lora.adapter import LoraAdapter
from transformers_openai.runners.lora.layers import LoraPair, LoraRows, add_lora, wrap_linear_layers

LAYER = "model.layers.0.proj"
IN, OUT = 12, 10


def _adapter(name: str, rank: int, seed: int, scaling: float) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    pair = LoraPair(torch.randn(rank, IN, generator=generator), torch.randn(OUT, rank, generator=generator), scaling)
    return LoraAdapter(name, name, Path(name), rank, None, {LAYER: pair})


def _layer(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Linear, LoraRows]:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    base = torch.nn.Linear(IN, OUT).to(dtype)
    model.model.layers[0].proj = base
    rows, _ = wrap_linear_layers(model)
    return model.model.layers[0].proj, base, rows


def _reference(base: torch.nn.Linear, x: torch.Tensor, chosen: list[LoraAdapter | None]) -> torch.Tensor:
    """Each row alone, in float64: the base layer plus its adapter's `x @ a.T @ b.T * scaling`."""
    weight, bias = base.weight.double(), base.bias.double()
    rows = []
    for row, adapter in zip(x.double(), chosen, strict=True):
        out = row @ weight.T + bias
        if adapter is not None:
            pair = adapter.pairs[LAYER]
            out = out + row @ pair.a.double().T @ pair.b.double().T * pair.scaling
        rows.append(out)
    return torch.stack(rows)


A, B, C = _adapter("a", 4, 1, 2.0), _adapter("b", 2, 2, 2.0), _adapter("c", 3, 3, 0.25)
CASES: dict[str, list[LoraAdapter | None]] = {
    "one adapter on every row": [A, A, A, A, A],
    "one adapter on some rows": [None, A, None, A, None],
    "two adapters, one scaling, rows without": [A, None, B, A, B],
    "three adapters, differing scalings": [C, A, None, B, C],
    "differing scalings, every row": [C, A, B, B, C],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [1, 3])
def test_each_row_gets_its_own_update(case: str, tokens: int) -> None:
    layer, base, rows = _layer()
    chosen = CASES[case]
    x = torch.randn(len(chosen), tokens, IN, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode(), rows.using(chosen, torch.device("cpu")):
        out = layer(x)
    torch.testing.assert_close(out.double(), _reference(base, x, chosen), rtol=1e-5, atol=1e-5)


def test_rows_without_an_adapter_are_the_base_layers_output_exactly() -> None:
    layer, base, rows = _layer()
    chosen = CASES["three adapters, differing scalings"]
    x = torch.randn(len(chosen), 2, IN)
    with torch.inference_mode(), rows.using(chosen, torch.device("cpu")):
        out = layer(x)
    with torch.inference_mode():
        assert torch.equal(out[2], base(x)[2])  # the batch's base product, untouched


def test_kept_groupings_follow_the_rows_from_step_to_step() -> None:
    """The same rows again reuse their grouping; changed rows, and a return to earlier ones, get their own."""
    layer, base, rows = _layer()
    x = torch.randn(5, 1, IN)
    steps: list[list[LoraAdapter | None]] = [
        CASES["two adapters, one scaling, rows without"],
        CASES["three adapters, differing scalings"],
    ]
    steps += [steps[0], CASES["one adapter on some rows"], steps[1], [None] * 5]
    seen = []
    for chosen in steps:
        with torch.inference_mode(), rows.using(chosen, torch.device("cpu")):
            out = layer(x)
            seen.append((rows.groups, rows.stacked))
        torch.testing.assert_close(out.double(), _reference(base, x, chosen), rtol=1e-5, atol=1e-5)
    assert seen[2][0] is seen[0][0] and seen[2][1] is seen[0][1]  # kept, not rebuilt
    assert seen[4][1] is seen[1][1]
    assert rows.groups == [] and rows.stacked is None  # outside `using`: the base alone


def test_bfloat16_layers_stay_close_to_the_reference() -> None:
    layer, base, rows = _layer(torch.bfloat16)
    bf16 = {name: _bf16(adapter) for name, adapter in (("a", A), ("b", B), ("c", C))}
    chosen = [bf16["c"], bf16["a"], None, bf16["b"], bf16["a"]]
    x = torch.randn(5, 1, IN).to(torch.bfloat16)
    with torch.inference_mode(), rows.using(chosen, torch.device("cpu")):
        out = layer(x)
    _assert_close_in_bfloat16(out, _reference(base, x, chosen))


def _assert_close_in_bfloat16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within a few bfloat16 roundings (8 bits of mantissa) of the result's scale: a sum that cancels to near zero
    keeps the rounding errors of its terms."""
    error = (actual.double() - expected).abs().max().item()
    assert error <= 2e-2 * expected.abs().max().item(), error


def _bf16(adapter: LoraAdapter) -> LoraAdapter:
    pair = adapter.pairs[LAYER]
    pairs = {LAYER: LoraPair(pair.a.bfloat16(), pair.b.bfloat16(), pair.scaling)}
    return LoraAdapter(adapter.name, adapter.name, adapter.path, adapter.rank, None, pairs)


@pytest.mark.parametrize("every_row", [True, False])
def test_an_output_of_another_dtype_or_layout_gets_the_update_too(every_row: bool) -> None:
    """A base whose output is float32 under bfloat16 adapters, or not contiguous, takes the cast-and-add path."""
    pair = LoraPair(torch.randn(3, IN).bfloat16(), torch.randn(OUT, 3).bfloat16(), 0.5)
    x = torch.randn(4, 2, IN).bfloat16()
    index = torch.arange(4) if every_row else torch.tensor([1, 3])
    expected_rows = x.double()[index] @ pair.a.double().T @ pair.b.double().T * 0.5
    for out in (torch.zeros(4, 2, OUT), torch.zeros(4, OUT, 2).bfloat16().transpose(1, 2)):
        result = add_lora(out, x, [(index, pair)])
        _assert_close_in_bfloat16(result[index], expected_rows)
        if not every_row:
            assert not result[[0, 2]].any()
