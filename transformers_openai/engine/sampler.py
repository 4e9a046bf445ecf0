"""One vectorized sampler for the whole batch, with per-row parameters and per-row random generators."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.runners.base import LogitsProcessor


@dataclass
class SamplerRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    stop_token_ids: frozenset[int]


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (chosen logprob, [(token, logprob)] top-n) when that row asked for logprobs.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Applies biases, penalties, temperature, top-k, top-p and min-p per row, then draws each row's token.

    Each row draws its uniform number from its own `torch.Generator`, so a seeded request gives the
    same tokens whatever else shares its batch. Logprobs are those of the model's distribution after the
    model kind's own rules (`processors`), before any request's sampling settings.
    """

    def __init__(self, processors: Sequence[LogitsProcessor] = ()) -> None:
        self._processors = tuple(processors)

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow]) -> SampleResult:
        # The processors rule in place: on a copy, so that a retry of some rows starts from the model's logits.
        logits = logits.to(torch.float32, copy=bool(self._processors))
        for processor in self._processors:
            processor(logits, rows)
        raw_logprobs = self._raw_logprobs(logits, rows)
        logits = self._adjust(logits.clone(), rows)
        chosen = self._draw(logits, rows)
        token_ids = chosen.tolist()
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                n = row.params.logprobs
                if n is None:
                    continue
                top: list[tuple[int, float]] = []
                if n > 0:
                    values, indices = raw_logprobs[i].topk(n)
                    top = list(zip(indices.tolist(), values.tolist(), strict=True))
                logprobs[i] = (float(raw_logprobs[i, token_ids[i]]), top)
        return SampleResult(token_ids, logprobs)

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor | None:
        if all(row.params.logprobs is None for row in rows):
            return None
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def _adjust(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            params = row.params
            if params.logit_bias:
                ids = torch.tensor([t for t in params.logit_bias if 0 <= t < vocab], dtype=torch.long)
                bias = torch.tensor([params.logit_bias[t] for t in ids.tolist()], dtype=logits.dtype)
                logits[i].index_add_(0, ids.to(logits.device), bias.to(logits.device))
            if len(row.output_ids) < params.min_tokens and row.stop_token_ids:
                logits[i, list(row.stop_token_ids)] = float("-inf")
            if params.has_penalties:
                _apply_penalties(logits[i], row)
        return logits

    @staticmethod
    def _draw(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        chosen = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            return chosen
        device = logits.device
        index = torch.tensor(sampled, device=device)
        params = [rows[i].params for i in sampled]
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        sorted_logits, sorted_ids = (logits.index_select(0, index) / temperature).sort(dim=-1, descending=True)
        rank = torch.arange(sorted_logits.shape[-1], device=device).unsqueeze(0)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else sorted_logits.shape[-1] for p in params], device=device)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        # Keep a token while the mass before it is below top_p (the first token always stays).
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
        cdf = probs.cumsum(dim=-1)
        uniform = torch.cat([torch.rand(1, generator=rows[i].generator) for i in sampled]).to(device)
        pick = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1)).clamp_(max=cdf.shape[-1] - 1)
        # searchsorted may land on a zero-probability slot only at the very end; step back to a kept one.
        kept = probs.gather(1, pick) > 0
        pick = torch.where(kept, pick, torch.zeros_like(pick))
        chosen[index] = sorted_ids.gather(1, pick).squeeze(1)
        return chosen


def _apply_penalties(row_logits: torch.Tensor, row: SamplerRow) -> None:
    params = row.params
    device = row_logits.device
    vocab = row_logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in row.prompt_ids + row.output_ids if t < vocab}), dtype=torch.long)
        if seen.numel():
            seen = seen.to(device)
            values = row_logits[seen]
            penalty = params.repetition_penalty
            row_logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if row.output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(row.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(device=device, dtype=row_logits.dtype)
        row_logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row_logits.dtype)
