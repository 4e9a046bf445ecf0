"""The device side of a decoder's step over the paged K/V pool: what every tensor-parallel rank runs alike.

The runner decides which rows a step runs and which blocks they hold (host bookkeeping); a `StepExecutor` turns
that into the model's forward over the pool, or into a copy between pool slots. With tensor parallelism rank 0's
executor first sends each call to the other ranks (`parallel/lockstep.py`), whose own executors run it over their
shards of the model and of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_cache import cache_keyword
from transformers_openai.runners.kv.paged_cache import PagedKVCache, StepPlan

StepRows = Sequence[tuple[BlockTable, list[int]]]  # each row's blocks (and the tokens they hold), its new tokens

# Attention kernels an eager step may use on CUDA: not cuDNN's, which plans every new shape on the host (an eager
# step spent far longer planning than computing; the figures are in docs/performance.md). Captured steps keep it:
# it is planned once, at capture, and needs the least memory.
EAGER_CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
        # Grouped attention applies each group's own mask: transformers is handed a 4-D placeholder, which it passes
        # through as it is instead of building a padded mask the step would never read.
        self._placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=cache.device) if grouped else None

    def _eager_kernels(self) -> AbstractContextManager[Any]:
        return sdpa_kernel(EAGER_CUDA_ATTENTION) if self.cache.device.type == "cuda" else nullcontext()

    def forward(self, rows: StepRows, keep: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`, when given, replace the rows' own (`[3, rows, queries]` multimodal ones, left-padded)."""
        plan = self.cache.plan([(table, len(tokens)) for table, tokens in rows])
        padding = [0] * plan.queries  # rows right-aligned: a row with fewer new tokens is padded on the left
        input_ids = torch.tensor([padding[len(tokens) :] + list(tokens) for _, tokens in rows], dtype=torch.long)
        return self._run(plan, keep, positions, input_ids=input_ids.to(self.cache.device))

    def forward_embeds(
        self, rows: Sequence[tuple[BlockTable, torch.Tensor]], keep: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As `forward`, each row's new positions given as input embeddings `[tokens, hidden]` (on the cache's
        device) instead of token ids: a vision-language model's prompt with its image features merged in."""
        plan = self.cache.plan([(table, len(embeds)) for table, embeds in rows])
        first = rows[0][1]
        inputs = first.new_zeros(len(rows), plan.queries, first.shape[-1])  # left padding reads zeros
        for i, (_, embeds) in enumerate(rows):
            inputs[i, plan.queries - len(embeds) :] = embeds
        return self._run(plan, keep, positions, inputs_embeds=inputs)

    def _run(self, plan: StepPlan, keep: int, positions: torch.Tensor | None, **inputs: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        with cache.running(plan), self._eager_kernels():
            out = self.model(
                **inputs,
                position_ids=plan.positions if positions is None else positions.to(cache.device),
                attention_mask=plan.mask if self._placeholder_mask is None else self._placeholder_mask,
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_keyword: cache},
                **self._paged_kv,
            )
        logits: torch.Tensor = out.logits
        return logits

    def forward_planned(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The forward of a step the caller planned (the cache is running its plan): device tensors in, logits out,
        nothing on the host (`FixedSteps` captures it as a CUDA graph). `mask` is 4-D: transformers passes it on."""
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: self.cache},
            **self._paged_kv,
        )
        logits: torch.Tensor = out.logits
        return logits

    def copy_slots(self, source: Sequence[int], target: Sequence[int]) -> None:
        device = self.cache.device
        self.cache.copy_slots(torch.tensor(source, device=device), torch.tensor(target, device=device))
