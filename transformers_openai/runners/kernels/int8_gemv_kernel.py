"""An int8 CPU matrix-vector product for the few rows of a decode step, the int8 sibling of `gemv_kernel.py`.

An `Int8Linear` multiplies through `torch._int_mm` after rounding its input in several eager passes and scales the
integer result back in two more: at one row, where the time should be the weights read once, those passes and the
product's own overhead cost more than the reading. This kernel (`csrc/int8_gemv.cpp`) does the whole layer in one call:
rounds each row to int8 once (as `Int8Linear` does), sums the int8 products in int32 with VNNI's `vpdpbusd` (AVX-512
VNNI, else AVX-VNNI; plain C++ for tests) over a copy of the weight laid out once at load (`block_weight`), and scales
each block's sums back (and adds the bias) as it finishes them. Integer sums are exact and the float steps are the
same single roundings in the same order, so its rows equal the `_int_mm` path's bit for bit: a row's result does not
depend on whether its step had four rows or five (greedy answers under batching stay those of the request alone).

Built and kept like the float kernel (`native_build.py`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from transformers_openai.int8_linear import KERNEL_MAX_ROWS, Int8Linear, this_cpu_flags
from transformers_openai.runners.kernels.native_build import build_and_load

logger = logging.getLogger(__name__)

OP = "transformers_openai::int8_gemv"
SOURCE_FILE = Path(__file__).parent / "csrc" / "int8_gemv.cpp"  # shipped as package data
BLOCK = 16  # output channels a block interleaves
GROUP = 4  # inputs one 32-bit lane of a channel holds
MAX_ROWS = KERNEL_MAX_ROWS  # inputs of more rows go to `torch._int_mm`
# The kernel's variants (`int8_gemv(..., variant=)`): AUTO picks the fastest this CPU runs.
AUTO, PLAIN, AVX_VNNI, AVX512_VNNI = 0, 1, 2, 3
NAMES = {PLAIN: "plain C++", AVX_VNNI: "AVX-VNNI", AVX512_VNNI: "AVX-512 VNNI"}
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})  # /proc/cpuinfo's names of the instructions the kernel needs


def load(directory: Path) -> bool:
    """Makes `torch.ops.transformers_openai.int8_gemv` available: the library built for this CPU and torch, from
    `directory` where an earlier start left it, else built there now (seconds); False where there is no compiler or
    the build fails (int8 layers then keep `torch._int_mm` at every row count). Once loaded, never again."""
    if loaded():
        return True
    if not build_and_load(SOURCE_FILE, "int8_gemv", directory, "int8 matrix-vector kernel"):
        return False
    torch.library.register_fake(OP, _output_shape)
    torch.library.register_fake("transformers_openai::int8_linear", _linear_shape)
    return True


def loaded() -> bool:
    """Whether the operator is registered in this process."""
    return hasattr(torch.ops.transformers_openai, "int8_gemv")


def block_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 `weight` `[out, in]` laid out for the kernel, `[ceil(out / 16), ceil(in / 4), 16, 4]` (element
    `[b, g, j, t]` the weight of channel `16 b + j` for input `4 g + t`, zeros past the last channel and input), and
    what the kernel takes off each channel's sums for the 128 it adds to every input: 128 times the channel's sum of
    weights, int32, `[16 blocks]`."""
    out_features, in_features = weight.shape
    blocks, groups = -(-out_features // BLOCK), -(-in_features // GROUP)
    padded = F.pad(weight.detach(), (0, groups * GROUP - in_features, 0, blocks * BLOCK - out_features))
    blocked = padded.view(blocks, BLOCK, groups, GROUP).transpose(1, 2).contiguous()
    sums = padded.to(torch.int32).sum(dim=1, dtype=torch.int32) * 128
    return blocked, sums


def use_rows_kernel(model: torch.nn.Module, kernels: Path) -> int:
    """Gives every float32 `Int8Linear` of `model` this kernel for 1-4 rows, built (or found) in `kernels`, where
    this CPU has VNNI (without it the plain C++ would be slower than oneDNN's product); returns how many layers got
    it (0 where the kernel cannot be built: `torch._int_mm` serves every row count)."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear) and m.takes_rows_kernel]
    if not layers:
        return 0
    if not VNNI_FLAGS & this_cpu_flags():  # not built where it would not be used
        logger.info("no int8 matrix-vector kernel: this CPU has neither AVX-512 VNNI nor AVX-VNNI")
        return 0
    if not load(kernels):
        return 0
    variant = best_variant()
    if variant == PLAIN:
        logger.info("no int8 matrix-vector kernel: this CPU has neither AVX-512 VNNI nor AVX-VNNI")
        return 0
    with torch.no_grad():
        for layer in layers:
            layer.add_rows_kernel(*block_weight(layer.weight))
    logger.info("%d int8 layers multiply 1-4 rows with the int8 matrix-vector kernel (%s)", len(layers), NAMES[variant])
    return len(layers)


def int8_gemv(
    x: torch.Tensor,
    blocked: torch.Tensor,
    weight_sums: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    variant: int = AUTO,
) -> torch.Tensor:
    """`Int8Linear`'s product for `x` `[rows, in]` (float32) with the weight laid out by `block_weight`; returns
    `[rows, out_features]` float32. Any row count is right; up to four rows read the weight once."""
    y: torch.Tensor = torch.ops.transformers_openai.int8_gemv(
        x, blocked, weight_sums, weight_scale, bias, out_features, variant
    )
    return y


def variants() -> list[int]:
    """The kernel's variants this CPU runs (PLAIN always), fastest last."""
    return [v for v in (PLAIN, AVX_VNNI, AVX512_VNNI) if torch.ops.transformers_openai.int8_gemv_has_variant(v)]


def best_variant() -> int:
    """The variant `int8_gemv` runs when not told."""
    return int(torch.ops.transformers_openai.int8_gemv_variant())


def _linear_shape(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    blocked: torch.Tensor,
    weight_sums: torch.Tensor,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight_t.shape[1])


def _output_shape(
    x: torch.Tensor,
    blocked: torch.Tensor,
    weight_sums: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    variant: int = AUTO,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
