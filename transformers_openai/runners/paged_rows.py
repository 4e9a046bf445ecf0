"""The rows of a runner over a paged K/V pool: sizing the pool from a memory budget, reservations, growth, usage."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from transformers_openai.runners.base import KVUsage, PrefillJob
from transformers_openai.runners.block_pool import BlockPool, BlockTable
from transformers_openai.runners.paged_cache import KVGeometry, PagedKVCache

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


class PagedRows:
    """A runner's K/V pool and the block tables of its rows (by slot) and of the jobs admitted to prefill.

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
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(geometry, num_blocks, block_size, model.device, group_padding)
        self.tables: dict[int, BlockTable] = {}  # running rows by slot, in the order they joined
        self._seed: bytes | None = b"" if shared_prefixes else None
        logger.info(
            "K/V pool: %d blocks of %d tokens (%.0f MiB, %d tokens)%s",
            num_blocks - 1, block_size, num_blocks * block_bytes / 2**20, self.token_capacity,
            f", plus {reserved_bytes / 2**20:.0f} MiB of cross-attention" if reserved_bytes else "",
        )

    @property
    def token_capacity(self) -> int:
        """The most tokens one request can ever hold."""
        return self.pool.usable * self.pool.block_size

    def reserve(self, job: PrefillJob, tokens: int, reuse_prefix: bool) -> bool:
        """Gives a job about to start its prefill the blocks for `tokens` tokens, reusing cached ones its prompt
        starts with; False (nothing held) when the pool cannot, keeping a block per running row for its growth."""
        if job.kv is not None:
            return True
        table = BlockTable(prefix_seed=self._seed)
        if reuse_prefix:
            job.done = self.pool.match_prefix(table, job.prompt_token_ids)
        needed = self.pool.blocks_for(tokens) - len(table.blocks)
        if needed > self.pool.available - len(self.tables) or not self.pool.grow(table, tokens):
            self.pool.release(table)
            job.done = 0
            return False
        job.kv = table
        return True

    def discard(self, job: PrefillJob) -> None:
        if isinstance(job.kv, BlockTable):
            self.pool.release(job.kv)
        job.kv = None

    def join(self, slot: int, job: PrefillJob) -> None:
        """The job's table becomes the row `slot`'s."""
        self.tables[slot] = job.kv
        job.kv = None

    def release(self, slot: int) -> None:
        self.pool.release(self.tables.pop(slot))

    def grow(self) -> bool:
        """Room for one more token in every row; False (nothing taken) when the pool is short."""
        pool = self.pool
        short = [t for t in self.tables.values() if pool.blocks_for(t.length + 1) > len(t.blocks)]
        if len(short) > pool.available:
            return False
        for table in short:
            pool.grow(table, table.length + 1)
        return True

    def usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(
            blocks_used=pool.used,
            blocks_total=pool.usable,
            blocks_cached=pool.cached,
            prefix_queries=pool.prefix_queries,
            prefix_hits=pool.prefix_hits,
        )

    def copy_slots(
        self, source: BlockTable, target: BlockTable, length: int, start: int = 0
    ) -> tuple[list[int], list[int]]:
        """The pool slots of tokens `start..length` in `source` and in `target` (blocks reserved): what copying
        `source`'s K/V into the same places of `target` copies."""
        size = self.pool.block_size
        return (
            [source.slot(position, size) for position in range(start, length)],
            [target.slot(position, size) for position in range(start, length)],
        )
