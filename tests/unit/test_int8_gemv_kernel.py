"""The int8 matrix-vector kernel for a few rows gives an `Int8Linear`'s `torch._int_mm` path's very bits, in every
variant this CPU runs (AVX-512 VNNI, AVX-VNNI, plain C++), for any row count, odd shapes and SmolLM2's: a row's
result must not depend on whether its step had four rows (the kernel) or more (`_int_mm`), or greedy answers under
batching would part from the request alone. A layer given the kernel sends 1-4 rows through it, and a model gets it
on every int8 layer where the CPU has VNNI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from transformers_openai.int8_linear import Int8Linear, int8_matmul_works, quantize_linear_layers
from transformers_openai.runners.kernels import int8_gemv_kernel
from transformers_openai.runners.kernels.int8_gemv_kernel import use_rows_kernel
from transformers_openai.runners.steps.step_store import has_cxx_compiler

pytestmark = [
    pytest.mark.skipif(not has_cxx_compiler(), reason="the kernel is built with a C++ compiler"),
    pytest.mark.skipif(not int8_matmul_works(), reason="this torch build has no int8 matrix product"),
]

# Odd shapes (a channel block and an input group cut short), then SmolLM2-135M's: q/o, k/v, gate/up and down.
SHAPES = [(37, 53), (16, 16), (1, 7), (100, 3), (250, 130), (576, 576), (192, 576), (1536, 576), (576, 1536)]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kernels")
    assert int8_gemv_kernel.load(directory)
    return directory


def int8_layer(out_features: int, in_features: int, bias: bool, generator: torch.Generator) -> Int8Linear:
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)
        if linear.bias is not None:
            linear.bias.normal_(generator=generator)
    return Int8Linear.from_linear(linear)


def inputs(rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random rows with an outlier in the first (a row's scale set by one value, as activations' often are) and, from
    three rows on, a row of zeros (the smallest scale)."""
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, in_features // 2] = 40.0
    if rows >= 3:
        x[2] = 0.0
    return x


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_every_variant_gives_the_int_mm_path_bit_for_bit(kernels: Path, out_features: int, in_features: int) -> None:
    """Rows 1-6 (six: a group of four, then two), with and without a bias: each variant's result equals the layer's
    own `_int_mm` path exactly."""
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    variants = int8_gemv_kernel.variants()
    assert int8_gemv_kernel.PLAIN in variants and int8_gemv_kernel.best_variant() == variants[-1]
    for bias in (True, False):
        layer = int8_layer(out_features, in_features, bias, generator)
        blocked, sums = int8_gemv_kernel.block_weight(layer.weight)
        assert blocked.shape == (-(-out_features // 16), -(-in_features // 4), 16, 4)
        for rows in range(1, 7):
            x = inputs(rows, in_features, generator)
            expected = layer(x)
            for variant in variants:
                got = int8_gemv_kernel.int8_gemv(
                    x, blocked, sums, layer.weight_scale, layer.bias, out_features, variant
                )
                assert torch.equal(got, expected), (variant, rows, bias, float((got - expected).abs().max()))


def test_wrong_inputs_and_a_missing_variant_are_refused(kernels: Path) -> None:
    layer = int8_layer(40, 24, False, torch.Generator().manual_seed(0))
    blocked, sums = int8_gemv_kernel.block_weight(layer.weight)
    x = torch.randn(2, 24)
    with pytest.raises(RuntimeError, match="cannot run int8_gemv variant"):
        int8_gemv_kernel.int8_gemv(x, blocked, sums, layer.weight_scale, None, 40, 9)
    with pytest.raises(RuntimeError, match="x's width"):
        int8_gemv_kernel.int8_gemv(torch.randn(2, 28), blocked, sums, layer.weight_scale, None, 40)
    with pytest.raises(RuntimeError, match="float32"):
        int8_gemv_kernel.int8_gemv(x.double(), blocked, sums, layer.weight_scale, None, 40)


def test_a_layer_with_the_kernel_sends_few_rows_through_it(kernels: Path) -> None:
    """1-4 rows (of a batch-shaped input too) give the kernel's result, which is the plain layer's; 5 rows go to
    `_int_mm`, the same as the plain layer's; and so in a compiled graph."""
    generator = torch.Generator().manual_seed(1)
    layer = int8_layer(45, 70, True, generator)
    plain = Int8Linear(layer.weight, layer.weight_scale, layer.bias, torch.float32)
    assert layer.takes_rows_kernel
    layer.add_rows_kernel(*int8_gemv_kernel.block_weight(layer.weight))
    assert "rows_kernel=True" in repr(layer)
    assert layer.blocked_weight is not None and layer.weight_sums is not None
    with torch.inference_mode():
        for rows in range(1, 6):
            x = torch.randn(1, rows, 70, generator=generator)
            assert torch.equal(layer(x), plain(x))
            if rows <= 4:
                kernel = int8_gemv_kernel.int8_gemv(
                    x[0], layer.blocked_weight, layer.weight_sums, layer.weight_scale, layer.bias, 45
                )
                assert torch.equal(layer(x)[0], kernel)
    # The layer in a compiled graph: one C++ operator (`int8_linear`), the kernel or the `_int_mm` passes by the rows.
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (1, 3, 4, 5, 9):
            x = inputs(rows, 70, generator)
            assert torch.equal(compiled(x), plain(x)), rows
            whole = torch.ops.transformers_openai.int8_linear(
                x, layer.weight_t, layer.weight_scale, layer.bias, layer.blocked_weight, layer.weight_sums
            )
            assert torch.equal(whole, plain(x)), rows


def test_a_bfloat16_layer_keeps_int_mm() -> None:
    layer = int8_layer(32, 32, False, torch.Generator().manual_seed(2))
    half = Int8Linear(layer.weight, layer.weight_scale, None, torch.bfloat16)
    assert not half.takes_rows_kernel


def test_every_int8_layer_of_a_model_gets_the_kernel_where_the_cpu_has_vnni(
    kernels: Path, tiny_llama_dir: Path
) -> None:
    """Where the CPU has VNNI every int8 layer gets the kernel, and a prompt of four tokens (the kernel's rows) gets
    the logits it got without it; elsewhere no layer gets it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    quantize_linear_layers(model)
    ids = torch.tensor([[1, 5, 9, 14]])
    with torch.inference_mode():
        before = model(ids).logits
        given = use_rows_kernel(model, kernels)
        after = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    vnni = int8_gemv_kernel.best_variant() != int8_gemv_kernel.PLAIN
    assert len(layers) == 14 and given == (len(layers) if vnni else 0)
    assert all((layer.blocked_weight is not None) == vnni for layer in layers)
    assert torch.equal(after, before)


def test_a_cpu_without_vnni_keeps_int_mm(kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU's flags: no layer gets the kernel (its plain C++ would be slower than `_int_mm`)."""
    model = torch.nn.Sequential(int8_layer(32, 32, False, torch.Generator().manual_seed(3)))
    monkeypatch.setattr(int8_gemv_kernel, "this_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert use_rows_kernel(model, kernels) == 0
    assert model[0].blocked_weight is None
