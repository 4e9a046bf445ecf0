"""Attention that reads each row's K/V from the paged pool at the row's own length, registered with transformers'
`AttentionInterface` so decoder models use it without any copied model code.

The rows of a step are split into groups of similar lengths (`PagedKVCache.plan`); each group gathers only its own
columns and runs one `scaled_dot_product_attention`, so one long conversation among short ones no longer pads every
row to its length. Models whose attention is not plain causal attention over all earlier tokens (sliding windows,
logit soft-capping) keep transformers' own sdpa over the rows read back padded.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PAGED_SDPA = "paged_sdpa"


def paged_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A forward given `paged_kv=<PagedKVCache>` attends over the pool; any other forward is plain sdpa."""
    cache = kwargs.pop("paged_kv", None)
    if cache is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    output: torch.Tensor = cache.attend(module.layer_idx, query, scaling)
    return output, None


def use_paged_attention(model: PreTrainedModel) -> bool:
    """Switches a model served with sdpa to the paged attention when its attention is plain causal attention."""
    config = model.config.get_text_config(decoder=True)
    plain = (
        model.config._attn_implementation in ("sdpa", PAGED_SDPA)
        and not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
        and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())
        and not getattr(config, "attn_logit_softcapping", None)
    )
    if not plain:
        return False
    AttentionInterface.register(PAGED_SDPA, paged_sdpa_attention)
    AttentionMaskInterface.register(PAGED_SDPA, sdpa_mask)  # what a forward without the pool falls back on
    model.set_attn_implementation(PAGED_SDPA)
    return True
