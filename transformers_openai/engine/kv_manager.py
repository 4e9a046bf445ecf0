"""The scheduler side's K/V memory: which blocks of the runner's pool each request holds, and what they hold.

The runner sizes its pool and says so (`KVPoolSpec`); from then on this manager alone hands out blocks: a request's
table at admission (reusing cached blocks its prompt starts with), one more token's room for every row before a
decode step, the record of what each step wrote (full blocks join the prefix cache), and the blocks given back when
a request leaves. The runner receives the tables and never allocates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from transformers_openai.engine.block_pool import BlockPool
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.runners.base import KVPoolSpec
from transformers_openai.runners.kv.block_table import BlockTable


@dataclass(frozen=True)
class KVUsage:
    """The K/V pool's state: blocks held by requests (cached prefixes nobody holds count as free), and the prefix
    cache's lookups (prompt tokens looked up, and found)."""

    blocks_used: int
    blocks_total: int
    blocks_cached: int = 0  # of the free ones, those keeping a prefix for reuse
    prefix_queries: int = 0
    prefix_hits: int = 0


class KVManager:
    """Block tables for the requests of one runner's pool (see the module's docstring)."""

    def __init__(self, spec: KVPoolSpec) -> None:
        self.pool = BlockPool(spec.num_blocks, spec.block_size)
        self._seed: bytes | None = b"" if spec.shared_prefixes else None

    def reserve(self, job: PrefillJob, tokens: int, running: int) -> bool:
        """Gives a job about to start its prefill a table with room for `tokens` tokens, reusing the cached blocks its
        prompt starts with (unless its prompt is scored: every position's logits are needed), which `job.done` then
        skips. False (nothing held) when the pool cannot, keeping a block for the growth of each of the `running`
        rows."""
        if job.kv is not None:
            return True
        table = BlockTable(prefix_seed=self._prefix_seed(job))
        if job.prompt_logprobs is None:
            job.done = self.pool.match_prefix(table, job.decoder_prompt)
        needed = self.pool.blocks_for(tokens) - len(table.blocks)
        if needed > self.pool.available - running or not self.pool.grow(table, tokens):
            self.pool.release(table)
            job.done = 0
            return False
        job.kv = table
        return True

    def _prefix_seed(self, job: PrefillJob) -> bytes | None:
        """Where a job's chain of block digests starts: a prompt with images starts from their digest, so the same
        tokens with other images never share blocks, and the same images and tokens do; likewise a prompt run with a
        LoRA adapter starts from that adapter's key, so blocks are never shared across adapters."""
        seed = self._seed
        if seed is None:
            return None
        if job.lora is not None:
            seed += b"lora:" + job.lora.key.encode() + b"\0"
        images = job.encoder_inputs.get("image_digest")
        return seed + images.encode() if isinstance(images, str) else seed

    def grow(self, tables: Iterable[BlockTable]) -> bool:
        """Room for one more token in each of the running rows' `tables`; False (nothing taken) when the pool is
        short (the engine then preempts a request and asks again)."""
        pool = self.pool
        short = [table for table in tables if pool.blocks_for(table.length + 1) > len(table.blocks)]
        if len(short) > pool.available:
            return False
        for table in short:
            pool.grow(table, table.length + 1)
        return True

    def room(self, table: BlockTable, tokens: int) -> int:
        """Room in `table` for up to `tokens` more tokens after what it holds, taking free blocks only when the pool
        has them to spare (the others' growth comes first: no one is preempted for it); returns how many fit."""
        pool = self.pool
        if pool.grow(table, table.length + tokens):
            return tokens
        return min(tokens, len(table.blocks) * pool.block_size - table.length)

    def rolled_back(self, table: BlockTable) -> None:
        """A step wrote more than was kept (a draft's rejected tokens, past `table.length`): the blocks beyond what
        the table holds go back to the pool. They never joined the prefix cache (`written` records kept tokens
        only), and their slots are written over by the next steps."""
        self.pool.truncate(table, self.pool.blocks_for(table.length))

    def written(self, table: BlockTable, token_ids: list[int]) -> None:
        """A step wrote the K/V of `token_ids` at the table's end."""
        self.pool.written(table, token_ids)

    def prefilled(self, job: PrefillJob) -> None:
        """Records what a prefill step wrote of a job's decoder prompt (its first `job.done` tokens in all)."""
        table = job.kv
        if table is not None:
            self.pool.written(table, job.decoder_prompt[table.length : job.done])

    def release(self, job: PrefillJob) -> None:
        """Gives back the blocks of a request that leaves (finished, failed, cancelled or preempted)."""
        if job.kv is not None:
            self.pool.release(job.kv)
            job.kv = None

    def usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(
            blocks_used=pool.used,
            blocks_total=pool.usable,
            blocks_cached=pool.cached,
            prefix_queries=pool.prefix_queries,
            prefix_hits=pool.prefix_hits,
        )
