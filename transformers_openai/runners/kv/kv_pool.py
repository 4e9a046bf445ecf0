"""A runner's paged K/V pool: sized from a memory budget, its blocks handed out by the engine's K/V manager."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from transformers_openai.runners.base import KVPoolSpec
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.paged_cache import KVGeometry, PagedKVCache

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVSpace:
    """How much memory the K/V of the running requests may take (bytes, resolved), in blocks of `block_size` tokens.

    Encoder-decoder models keep their cross-attention K/V per row outside the pool; they are counted in `bytes` too.
    """

    bytes: int
    block_size: int = DEFAULT_BLOCK_SIZE


def self_attention_geometry(model: PreTrainedModel) -> KVGeometry:
    """One token's decoder self-attention K/V: the layer count from the config, heads and head size from the first
    attention module of the decoder (configs name them in too many ways); under tensor parallelism, this rank's."""
    config = model.config.get_text_config(decoder=True)
    layers = (
        getattr(config, "num_decoder_layers", None)
        or getattr(config, "decoder_layers", None)
        or config.num_hidden_layers
    )
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # type: ignore[no-untyped-call]
    for module in decoder.modules():
        head_dim = getattr(module, "head_dim", None) or getattr(module, "key_value_proj_dim", None)
        keys = getattr(module, "k_proj", None) or getattr(module, "k", None)
        width = getattr(keys, "out_features", None)  # an nn.Linear, or its packed stand-in
        shard = getattr(getattr(keys, "weight", None), "to_local", None)
        if callable(shard):  # a tensor-parallel shard (DTensor): this rank's heads only
            width = int(shard().shape[0])
        if isinstance(head_dim, int) and isinstance(keys, torch.nn.Module) and isinstance(width, int):
            return KVGeometry(int(layers), width // head_dim, head_dim, model.dtype)
    raise TypeError(f"no attention module with k_proj/k and head_dim found in {type(model).__name__}")


class KVPool:
    """A runner's paged K/V pool: its tensors (`cache`), sized from a memory budget, and what the engine's K/V
    manager needs to know of it (`spec`). The manager hands out the blocks; the runner only reads and writes them.

    Args:
        space: the budget; None sizes the pool for `max_rows` rows of `max_len` tokens (never short).
        reserved_bytes: memory the runner keeps outside the pool (cross-attention K/V), taken from the budget.
        shared_prefixes: whether full blocks are cached by content and reused by later prompts.
        group_padding: set when the model's attention reads the pool in groups (see `PagedKVCache`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_rows: int,
        max_len: int,
        space: KVSpace | None,
        reserved_bytes: int = 0,
        shared_prefixes: bool = True,
        group_padding: float | None = None,
    ) -> None:
        geometry = self_attention_geometry(model)
        block_size = space.block_size if space else DEFAULT_BLOCK_SIZE
        block_bytes = block_size * geometry.bytes_per_token
        if space is None:
            num_blocks = max_rows * -(-(max_len + 1) // block_size) + 1
        else:
            num_blocks = (space.bytes - reserved_bytes) // block_bytes
            if num_blocks < 2:
                raise ValueError(
                    f"--kv-cache-memory of {space.bytes / 2**20:.0f} MiB is too small for this model: "
                    f"{reserved_bytes / 2**20:.0f} MiB go to cross-attention and one block of {block_size} tokens "
                    f"takes {block_bytes / 2**20:.2f} MiB"
                )
        self.spec = KVPoolSpec(num_blocks, block_size, shared_prefixes)
        self.cache = PagedKVCache(geometry, num_blocks, block_size, model.device, group_padding)
        logger.info(
            "K/V pool: %d blocks of %d tokens (%.0f MiB, %d tokens)%s",
            num_blocks - 1,
            block_size,
            num_blocks * block_bytes / 2**20,
            self.spec.token_capacity,
            f", plus {reserved_bytes / 2**20:.0f} MiB of cross-attention" if reserved_bytes else "",
        )

    def copy_slots(
        self, source: BlockTable, target: BlockTable, length: int, start: int = 0
    ) -> tuple[list[int], list[int]]:
        """The pool slots of tokens `start..length` in `source` and in `target` (blocks reserved): what copying
        `source`'s K/V into the same places of `target` copies."""
        size = self.spec.block_size
        return (
            [source.slot(position, size) for position in range(start, length)],
            [target.slot(position, size) for position in range(start, length)],
        )
