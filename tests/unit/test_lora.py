"""LoRA without a server: the grouped product equals each row's own update, wrapped layers add it to their rows only,
and adapters that cannot be served are refused at load with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from transformers_openai.engine.lora_adapters import (
    AdapterError,
    LoraAdapters,
    LoraLimits,
    RuntimeLoadingOff,
    UnknownAdapter,
)
from transformers_openai.runners.lora.adapter import LoraAdapter
from transformers_openai.runners.lora.layers import (
    LoraPair,
    LoraRows,
    add_lora,
    add_stacked_lora,
    group_rows,
    wrap_linear_layers,
)
from transformers_openai.settings import Settings, joined_lora_modules

SHAPES = {"model.layers.0.proj": (6, 5)}


def _pair(rank: int, seed: int, scaling: float = 2.0) -> LoraPair:
    generator = torch.Generator().manual_seed(seed)
    return LoraPair(torch.randn(rank, 6, generator=generator), torch.randn(5, rank, generator=generator), scaling)


def _adapter(name: str, pair: LoraPair) -> LoraAdapter:
    return LoraAdapter(name, name, Path(name), pair.a.shape[0], None, {"model.layers.0.proj": pair})


def test_the_grouped_product_equals_each_rows_own_update() -> None:
    torch.manual_seed(0)
    x, base = torch.randn(7, 3, 6), torch.randn(7, 3, 5)
    pairs = [_pair(4, 1), _pair(2, 2, scaling=0.5)]
    chosen = [0, None, 1, 0, 1, None, 0]  # which pair each row uses
    groups = [(torch.tensor([i for i, c in enumerate(chosen) if c == k]), pair) for k, pair in enumerate(pairs)]
    out = add_lora(base.clone(), x, groups)
    for i, c in enumerate(chosen):
        expected = base[i] if c is None else base[i] + x[i] @ pairs[c].a.T @ pairs[c].b.T * pairs[c].scaling
        torch.testing.assert_close(out[i], expected)
    every = add_lora(base.clone(), x, [(torch.arange(7), pairs[1])])  # one adapter on every row: no gather
    torch.testing.assert_close(every, base + x @ pairs[1].a.T @ pairs[1].b.T * pairs[1].scaling)


@pytest.mark.parametrize("scalings", [(2.0, 2.0, 2.0), (2.0, 0.5, 1.5)])
def test_the_stacked_product_equals_each_rows_own_update(scalings: tuple[float, float, float]) -> None:
    torch.manual_seed(0)
    x, base = torch.randn(7, 3, 6), torch.randn(7, 3, 5)
    # Ranks differ (padded with zeros in the stack); the third adapter does not target the layer.
    pairs = [_pair(4, 1, scalings[0]), _pair(2, 2, scalings[1])]
    adapters = [_adapter("a", pairs[0]), _adapter("b", pairs[1]), LoraAdapter("c", "c", Path("c"), 2, None, {})]
    adapters[2].pairs["model.layers.9.other"] = _pair(2, 3, scalings[2])
    chosen = [0, None, 1, 2, 1, None, 0]
    rows = LoraRows()
    with rows.using([None if c is None else adapters[c] for c in chosen], torch.device("cpu")):
        assert rows.stacked is not None
        a, b = rows.stacks("model.layers.0.proj", (6, 5), base)
        out = add_stacked_lora(base.clone(), x, a, b, rows.stacked)
    for i, c in enumerate(chosen):
        if c is None or c == 2:
            torch.testing.assert_close(out[i], base[i])
        else:
            torch.testing.assert_close(out[i], base[i] + x[i] @ pairs[c].a.T @ pairs[c].b.T * pairs[c].scaling)


def test_rows_are_grouped_by_adapter_in_order_of_first_appearance() -> None:
    a, b = _adapter("a", _pair(2, 1)), _adapter("b", _pair(2, 2))
    groups = group_rows([b, None, a, b], torch.device("cpu"))
    assert [(adapter, index.tolist()) for adapter, index in groups] == [(b, [0, 3]), (a, [2])]


def test_a_wrapped_model_adds_each_adapter_to_its_rows_only() -> None:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].proj = torch.nn.Linear(6, 5)
    model.head = torch.nn.Linear(5, 5)  # outside the blocks: never wrapped
    base = model.model.layers[0].proj
    rows, shapes = wrap_linear_layers(model)
    assert shapes == SHAPES and isinstance(model.head, torch.nn.Linear)
    layer = model.model.layers[0].proj
    adapter = _adapter("a", _pair(3, 5))
    x = torch.randn(3, 2, 6)
    with torch.inference_mode(), rows.using([None, adapter, None], torch.device("cpu")):
        out = layer(x)
    pair = adapter.pairs["model.layers.0.proj"]
    with torch.inference_mode():
        torch.testing.assert_close(out[[0, 2]], base(x[[0, 2]]))
        torch.testing.assert_close(out[1], base(x[1]) + x[1] @ pair.a.T @ pair.b.T * pair.scaling)
        torch.testing.assert_close(layer(x), base(x))  # outside `using`: the base alone


def _write(path: Path, rank: int, shapes: tuple[tuple[int, ...], tuple[int, ...]], **config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8, **config}))
    layer = "base_model.model.model.layers.0.proj"
    tensors = {f"{layer}.lora_A.weight": torch.zeros(shapes[0]), f"{layer}.lora_B.weight": torch.zeros(shapes[1])}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _adapters(max_loras: int = 2, dirs: tuple[Path, ...] | None = None) -> LoraAdapters:
    limits = LoraLimits(max_loras=max_loras, max_rank=8, dirs=dirs)
    return LoraAdapters("base", SHAPES, torch.float32, torch.device("cpu"), limits)


def test_an_adapter_that_fits_is_read_with_peft_scaling(tmp_path: Path) -> None:
    adapter = _adapters().load("a", _write(tmp_path / "a", 4, ((4, 6), (5, 4))))
    assert adapter.rank == 4 and adapter.pairs["model.layers.0.proj"].scaling == 2.0


@pytest.mark.parametrize(
    ("rank", "shapes", "config", "reason"),
    [
        (16, ((16, 6), (5, 16)), {}, "above --max-lora-rank 8"),
        (4, ((4, 7), (5, 4)), {}, "does not fit this model"),
        (4, ((4, 6), (5, 4)), {"use_dora": True}, "DoRA"),
        (4, ((4, 6), (5, 4)), {"peft_type": "IA3"}, "only LoRA"),
        (0, ((4, 6), (5, 4)), {}, "no rank"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_with_the_reason(
    tmp_path: Path, rank: int, shapes: tuple[tuple[int, ...], tuple[int, ...]], config: dict[str, object], reason: str
) -> None:
    with pytest.raises(AdapterError, match=reason):
        _adapters().load("a", _write(tmp_path / "a", rank, shapes, **config))


def test_an_adapter_for_layers_the_model_lacks_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "a", 4, ((4, 6), (5, 4)))
    limits = LoraLimits(max_loras=2, max_rank=8)
    other = LoraAdapters("base", {"model.layers.0.other": (6, 5)}, torch.float32, torch.device("cpu"), limits)
    with pytest.raises(AdapterError, match="not a linear layer of this model"):
        other.load("a", path)
    with pytest.raises(AdapterError, match="no readable adapter_config.json"):
        other.load("a", tmp_path)


def test_names_room_run_time_paths_and_unloads(tmp_path: Path) -> None:
    inside = _write(tmp_path / "loras" / "a", 4, ((4, 6), (5, 4)))
    adapters = _adapters(max_loras=1, dirs=(tmp_path / "loras",))
    with pytest.raises(AdapterError, match="--lora-dir"):
        adapters.load("x", _write(tmp_path / "elsewhere", 4, ((4, 6), (5, 4))), at_run_time=True)
    with pytest.raises(AdapterError, match="--lora-dir"):
        adapters.load("x", tmp_path / "loras" / ".." / "elsewhere", at_run_time=True)
    with pytest.raises(AdapterError, match="base model"):
        adapters.load("base", inside, at_run_time=True)
    first = adapters.load("a", inside, at_run_time=True)
    with pytest.raises(AdapterError, match="already loaded"):
        adapters.load("a", inside, at_run_time=True)
    with pytest.raises(AdapterError, match="--max-loras"):
        adapters.load("b", inside, at_run_time=True)
    adapters.unload("a")
    with pytest.raises(UnknownAdapter):
        adapters.unload("a")
    again = adapters.load("a", inside, at_run_time=True)
    assert again.key != first.key  # blocks cached with the first load are never reused by the second
    with pytest.raises(RuntimeLoadingOff):
        _adapters().load("a", inside, at_run_time=True)
    with pytest.raises(RuntimeLoadingOff):
        _adapters().unload("a")


def test_lora_modules_are_read_in_vllms_form_and_ours() -> None:
    args = ["--lora-modules", "a=/x", "b=/y", "--port", "1", "--lora-modules=c=/z", "d=/w"]
    assert joined_lora_modules(args) == ["--lora-modules", "a=/x,b=/y", "--port", "1", "--lora-modules=c=/z,d=/w"]
    assert joined_lora_modules(["--api-key", "k=v"]) == ["--api-key", "k=v"]
    settings = Settings(model="m", lora_modules=["a=/x,b=/y", "c = /z"])
    assert settings.lora_paths == {"a": Path("/x"), "b": Path("/y"), "c": Path("/z")}
    with pytest.raises(ValueError, match="not name=path"):
        Settings(model="m", lora_modules=["/x"])
