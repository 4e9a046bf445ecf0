"""A CPU matrix-vector product for the few rows of a decode step at low concurrency.

At one to four rows a linear layer is its weights read once: the time is how fast they stream from memory. oneDNN's
packed product (`packed_linear.py`) is a matrix-product kernel, and at one row it read SmolLM2's weights at about
two fifths of the memory's speed. This kernel (`csrc/gemv.cpp`) reads a copy of each weight laid out once at load
(`block_weight`: blocks of 16 output features, their columns interleaved, each block one contiguous stream) with one
fused multiply-add per row for every 16 weights loaded: AVX-512 where the CPU has it, else AVX2 with FMA, else plain
C++, chosen when called from what the CPU reports. It registers `torch.ops.transformers_openai.gemv`, which
`PackedLinear` calls for inputs of at most `MAX_ROWS` rows, and `gemv_linear`, the layer's whole product (the kernel
or oneDNN's by the rows), which compiled graphs call as one opaque step.

Built and kept like the paged decode kernel (`native_build.py`)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from transformers_openai.runners.kernels.native_build import build_and_load

OP = "transformers_openai::gemv"
SOURCE_FILE = Path(__file__).parent / "csrc" / "gemv.cpp"  # shipped as package data
BLOCK = 16  # output features a block interleaves
MAX_ROWS = 4  # inputs of more rows go to oneDNN's packed product
# The kernel's variants (`gemv(..., variant=)`): AUTO picks the fastest this CPU runs.
AUTO, PLAIN, AVX2, AVX512 = 0, 1, 2, 3


def load(directory: Path) -> bool:
    """Makes `torch.ops.transformers_openai.gemv` available: the library built for this CPU and torch, from
    `directory` where an earlier start left it, else built there now (seconds); False where there is no compiler or
    the build fails (linear layers then keep oneDNN's product at every row count). Once loaded, never again."""
    if loaded():
        return True
    if not build_and_load(SOURCE_FILE, "gemv", directory, "matrix-vector kernel"):
        return False
    torch.library.register_fake(OP, _output_shape)
    torch.library.register_fake("transformers_openai::gemv_linear", _linear_shape)
    return True


def loaded() -> bool:
    """Whether the operator is registered in this process."""
    return hasattr(torch.ops.transformers_openai, "gemv")


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` laid out for the kernel: `[ceil(out / 16), in, 16]`, element `[b, k, j]` the weight of
    output feature `16 b + j` for input `k`, zeros past the last feature."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    padded = F.pad(weight.detach().float(), (0, 0, 0, blocks * BLOCK - out_features))
    return padded.view(blocks, BLOCK, in_features).transpose(1, 2).contiguous()


def gemv(
    x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int, variant: int = AUTO
) -> torch.Tensor:
    """`x W^T + b` for `x` `[rows, in]` (float32) and `W` laid out by `block_weight`; returns `[rows, out_features]`.
    Any row count is right; up to four rows read the weight once."""
    y: torch.Tensor = torch.ops.transformers_openai.gemv(x, blocked, bias, out_features, variant)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor) -> torch.Tensor:
    """A packed linear layer's `x W^T + b` given both its layouts: `blocked` (`block_weight`) multiplies inputs of at
    most `MAX_ROWS` rows, oneDNN's packed `weight` more; one C++ operator, which a compiled graph calls without
    entering Python."""
    y: torch.Tensor = torch.ops.transformers_openai.gemv_linear(x, weight, bias, blocked)
    return y


def variants() -> list[int]:
    """The kernel's variants this CPU runs (PLAIN always), fastest last."""
    return [v for v in (PLAIN, AVX2, AVX512) if torch.ops.transformers_openai.gemv_has_variant(v)]


def best_variant() -> int:
    """The variant `gemv` runs when not told."""
    return int(torch.ops.transformers_openai.gemv_variant())


def _linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _output_shape(
    x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int, variant: int = AUTO
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
