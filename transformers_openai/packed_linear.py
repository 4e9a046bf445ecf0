"""Linear layers whose weights oneDNN has laid out ahead of time for this CPU, swapped into a loaded model.

A model's `nn.Linear` multiplies through MKL's general matrix product, which packs the weight for the CPU's
vector units on every call. With a decode batch of a few rows that packing is a large share of the work: at 16
rows and 2 threads SmolLM2's output projection (576 x 49,152) takes 26 ms as `nn.Linear` and 10 ms packed once
(`stress-test/step_breakdown.py --weights plain,packed` shows the whole step). oneDNN's packed linear is the one
torch's own CPU compiler uses for frozen weights (`mkldnn._linear_pointwise`); results differ from MKL's only by
float rounding.
"""

from __future__ import annotations

import logging
from typing import cast

import torch

logger = logging.getLogger(__name__)


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` with `W` kept in oneDNN's blocked layout (the plain weight is not kept)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    @property
    def weight(self) -> torch.Tensor:
        """The packed weight: right shape, dtype and device for model code that inspects them (T5's feed-forward
        casts to `wo.weight.dtype`), but an opaque oneDNN tensor, not one to compute with."""
        return cast(torch.Tensor, self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear is there for `dtype` on this CPU and agrees with `nn.Linear`."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48, dtype=dtype)
    x = torch.randn(3, 5, 64, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            packed, plain = PackedLinear(linear)(x), linear(x)
    except RuntimeError as exc:  # a torch build without the op
        logger.info("packed CPU linear layers unavailable: %s", exc)
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(packed.float(), plain.float(), rtol=tolerance, atol=tolerance))


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Replaces every `nn.Linear` of a CPU model by a `PackedLinear`; returns how many (0 when it cannot)."""
    dtype = next(model.parameters()).dtype
    if not can_pack(dtype):
        return 0
    # By name, one at a time: each plain weight can go as soon as its packed copy is made.
    names = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    with torch.no_grad():
        for name in names:
            model.set_submodule(name, PackedLinear(cast(torch.nn.Linear, model.get_submodule(name))))
    return len(names)
