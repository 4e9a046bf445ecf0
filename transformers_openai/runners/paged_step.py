"""The device side of a decoder's step over the paged K/V pool: what every tensor-parallel rank runs alike.

The runner decides which rows a step runs and which blocks they hold (host bookkeeping); a `StepExecutor` turns
that into the model's forward over the pool, or into a copy between pool slots. With tensor parallelism rank 0's
executor first sends each call to the other ranks (`parallel/lockstep.py`), whose own executors run it over their
shards of the model and of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel

from transformers_openai.runners.block_pool import BlockTable
from transformers_openai.runners.kv_cache import cache_keyword
from transformers_openai.runners.paged_cache import PagedKVCache

StepRows = Sequence[tuple[BlockTable, list[int]]]  # each row's blocks (and the tokens they hold), its new tokens


class StepExecutor(Protocol):
    def forward(self, rows: StepRows, keep: int) -> torch.Tensor:
        """One forward adding each row's new tokens after what its table holds; logits `[rows, keep or tokens,
        vocab]` (keep 0: every new position's)."""
        ...

    def copy_slots(self, source: Sequence[int], target: Sequence[int]) -> None:
        """Copies the K/V at pool slots `source` to slots `target`, in every layer."""
        ...


class PagedStep:
    """Runs `model` over `cache`: rows right-aligned, each at its own positions, its K/V written to its blocks.

    `grouped`: the model attends through `paged_attention` (it is given the pool); otherwise the cache reads the rows
    back padded for the model's own attention.
    """

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, grouped: bool) -> None:
        self.model = model
        self.cache = cache
        self._cache_keyword = cache_keyword(model)
        self._paged_kv = {"paged_kv": cache} if grouped else {}

    def forward(self, rows: StepRows, keep: int) -> torch.Tensor:
        cache = self.cache
        plan = cache.plan([(table, len(tokens)) for table, tokens in rows])
        padding = [0] * plan.queries  # rows right-aligned: a row with fewer new tokens is padded on the left
        input_ids = torch.tensor([padding[len(tokens) :] + list(tokens) for _, tokens in rows], dtype=torch.long)
        with cache.running(plan):
            out = self.model(
                input_ids=input_ids.to(cache.device),
                position_ids=plan.positions,
                attention_mask=plan.mask,
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_keyword: cache},
                **self._paged_kv,
            )
        logits: torch.Tensor = out.logits
        return logits

    def copy_slots(self, source: Sequence[int], target: Sequence[int]) -> None:
        device = self.cache.device
        self.cache.copy_slots(torch.tensor(source, device=device), torch.tensor(target, device=device))
