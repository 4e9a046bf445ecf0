"""Cross-attention of encoder-decoder decode steps through the CPU kernel that reads `CrossKVCache`'s K/V as they
lie (keys transposed, `paged_decode_kernel.cross_attention`), registered with transformers' `AttentionInterface` so
the model's own attention code calls it. Every other attention call of the model (the encoder's, the decoder's
self-attention, prompts of several tokens, masked cross-attention such as T5's over padded inputs) is plain sdpa.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from transformers_openai.runners.kernels import paged_decode_kernel

CROSS_IN_PLACE = "cross_in_place_sdpa"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def cross_in_place_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One query per row over keys laid out position-minor (only `CrossKVCache` keeps them so), unmasked: the
    kernel; anything else: sdpa."""
    if reads_transposed_keys(query, key, value, attention_mask):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = paged_decode_kernel.cross_attention(query, key.transpose(-1, -2), value, scale)
        return out.transpose(1, 2), None  # [rows, 1, heads, dim], as sdpa's path returns it
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def reads_transposed_keys(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
) -> bool:
    return (
        attention_mask is None
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[2] == 1
        and query.dtype == key.dtype == value.dtype
        and query.dtype in KERNEL_DTYPES
        and key.shape[1] == query.shape[1]  # a K/V head per query head
        and key.shape[-1] > 1
        and key.shape[-2] > 1
        and key.stride(-2) == 1  # positions contiguous: the keys stored transposed
        and value.stride(-1) == 1
    )


def use_cross_in_place(model: PreTrainedModel, directory: Path) -> bool:
    """Switches a float32 or bfloat16 CPU model served with sdpa to the kernel for its decode steps'
    cross-attention, the kernel built in `directory` or loaded from there; False (nothing changed) where it cannot."""
    if model.config._attn_implementation != "sdpa" or model.dtype not in KERNEL_DTYPES or model.device.type != "cpu":
        return False
    if not paged_decode_kernel.load(directory):
        return False
    AttentionInterface.register(CROSS_IN_PLACE, cross_in_place_attention)
    AttentionMaskInterface.register(CROSS_IN_PLACE, sdpa_mask)
    model.set_attn_implementation(CROSS_IN_PLACE)
    return True
