"""The matrix-vector kernel for a few rows computes what `torch.nn.functional.linear` does, in every variant this
CPU runs (AVX-512, AVX2 with FMA, plain C++), for any row count and odd shapes; a packed layer with its layout sends
inputs of 1-4 rows through it and more rows to oneDNN, also from a compiled graph; and packing a model gives every
float32 layer (the tied output layer too) that layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from transformers_openai.runners.kernels import gemv_kernel
from transformers_openai.runners.packed_linear import PackedLinear, can_pack, pack_linear_layers, register_compilable_op
from transformers_openai.runners.steps.step_store import has_cxx_compiler

pytestmark = [
    pytest.mark.skipif(not has_cxx_compiler(), reason="the kernel is built with a C++ compiler"),
    pytest.mark.skipif(not can_pack(torch.float32), reason="this torch build has no oneDNN packed linear"),
]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kernels")
    assert gemv_kernel.load(directory)
    return directory


@pytest.mark.parametrize(("out_features", "in_features"), [(37, 53), (16, 16), (1, 7), (100, 3), (250, 130)])
def test_every_variant_computes_linear(kernels: Path, out_features: int, in_features: int) -> None:
    """Rows 1-5 (five: a group of four, then one), with and without a bias, each variant against `F.linear`."""
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    blocked = gemv_kernel.block_weight(weight)
    assert blocked.shape == (-(-out_features // 16), in_features, 16)
    variants = gemv_kernel.variants()
    assert gemv_kernel.PLAIN in variants and gemv_kernel.best_variant() == variants[-1]
    for rows in range(1, 6):
        x = torch.randn(rows, in_features, generator=generator)
        for variant in variants:
            for b in (bias, None):
                got = gemv_kernel.gemv(x, blocked, b, out_features, variant)
                torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_strided_input_and_a_missing_variant(kernels: Path) -> None:
    """A view of every other row is read through its stride; a variant that does not exist is refused."""
    weight, x = torch.randn(40, 24), torch.randn(6, 24)
    blocked = gemv_kernel.block_weight(weight)
    torch.testing.assert_close(gemv_kernel.gemv(x[::2], blocked, None, 40), F.linear(x[::2], weight))
    with pytest.raises(RuntimeError, match="cannot run gemv variant"):
        gemv_kernel.gemv(x, blocked, None, 40, 9)


def test_a_packed_layer_sends_few_rows_to_the_kernel(kernels: Path) -> None:
    """1-4 rows give exactly the kernel's result, 5 exactly oneDNN's; both agree with `nn.Linear`, eagerly and in a
    compiled graph (one C++ operator choosing at run time, `gemv_kernel.linear`)."""
    linear = torch.nn.Linear(70, 45)
    layer, plain = PackedLinear(linear, rows_kernel=True), PackedLinear(linear)
    assert "rows_kernel=True" in repr(layer)
    register_compilable_op()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in range(1, 6):
            x = torch.randn(rows, 70)
            blocked = layer.blocked_weight
            assert isinstance(blocked, torch.Tensor)
            routed = gemv_kernel.gemv(x, blocked, linear.bias, 45) if rows <= 4 else plain(x)
            assert torch.equal(layer(x), routed)
            assert torch.equal(compiled(x), routed)
            assert torch.equal(gemv_kernel.linear(x, layer.weight, linear.bias, blocked), routed)
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packing_gives_every_layer_the_kernel_layout(kernels: Path, tiny_llama_dir: Path) -> None:
    """The tied output layer included; the packed model's logits of one row equal the plain model's."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert pack_linear_layers(model, kernels) > 0
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.blocked_weight is not None for m in layers)
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits[:, -1], plain(ids).logits[:, -1], rtol=1e-4, atol=1e-4)


def test_the_kernel_copy_is_refused_past_a_quarter_of_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from transformers_openai import model_loader
    from transformers_openai.settings import Settings

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    weights = (64 * 64 + 64 * 32) * 4
    settings = Settings(model="unused", compile_cache_dir=tmp_path)
    monkeypatch.setattr(model_loader, "_total_memory", lambda: 4 * weights)
    assert model_loader._rows_kernel_store(settings, model) is not None
    monkeypatch.setattr(model_loader, "_total_memory", lambda: 4 * weights - 4)
    assert model_loader._rows_kernel_store(settings, model) is None
