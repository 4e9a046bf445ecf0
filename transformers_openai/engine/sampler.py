"""One vectorized sampler for the whole batch, with per-row parameters and per-row random generators."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transformers_openai.engine.request import TokenConstraint
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.runners.base import LogitsProcessor

# A top-p row draws among its top candidates only, once they are known to hold at least `top_p` of the mass: the
# first of these widths that holds it for every such row, else the whole vocabulary is ranked. Ranking a few dozen
# or hundred candidates costs far less than sorting 50k+ logits.
TOP_P_CANDIDATES = (64, 512)


@dataclass
class SamplerRow:
    """What the sampler needs to know about one row of the batch, and the tensors it keeps for it between steps."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    stop_token_ids: frozenset[int]
    state: RowState | None = None  # built at the row's first step
    constraint: TokenConstraint | None = None  # which tokens may come next (structured output)


class RowState:
    """A row's per-request tensors, built once: its logit bias, stop ids, and penalty counts kept up to date with one
    scatter per new token (instead of rebuilding them from the token lists every step)."""

    def __init__(self, row: SamplerRow, vocab: int, device: torch.device) -> None:
        params = row.params
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        self.stop_ids = torch.tensor(sorted(row.stop_token_ids), dtype=torch.long, device=device)
        self.seen: torch.Tensor | None = None  # tokens of prompt and output (repetition penalty)
        self.counts: torch.Tensor | None = None  # output token counts (presence and frequency penalties)
        self.counted = 0  # output tokens already in `seen` / `counts`
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[_in_vocab(row.prompt_ids, vocab, device)] = True
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)

    def catch_up(self, output_ids: list[int], vocab: int) -> None:
        """Adds the output tokens sampled since the last step to the penalty state."""
        new = output_ids[self.counted :]
        self.counted = len(output_ids)
        if not new:
            return
        device = self.stop_ids.device
        ids = _in_vocab(new, vocab, device)
        if self.seen is not None:
            self.seen[ids] = True
        if self.counts is not None:
            self.counts.index_add_(0, ids, torch.ones(ids.shape, dtype=self.counts.dtype, device=device))


def _in_vocab(ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long, device=device)


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
        constrained = [i for i, row in enumerate(rows) if row.constraint is not None]
        adjusted = [i for i, row in enumerate(rows) if _adjusts(row)]
        # What follows works in place: on a copy, so that a retry of some rows starts from the model's logits.
        logits = logits.to(torch.float32, copy=bool(self._processors or constrained or adjusted))
        for processor in self._processors:
            processor(logits, rows)
        for i in constrained:  # a request's own grammar, like the model kind's rules, before logprobs
            constraint = rows[i].constraint
            if constraint is not None:
                constraint.mask(logits[i])
        raw_logprobs = self._raw_logprobs(logits, rows)
        if adjusted:
            self._adjust(logits, rows, adjusted)
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
    def _adjust(logits: torch.Tensor, rows: list[SamplerRow], adjusted: list[int]) -> None:
        """Logit bias, min_tokens and penalties, in place, for the rows that have any."""
        vocab = logits.shape[-1]
        for i in adjusted:
            row = rows[i]
            params = row.params
            if row.state is None:
                row.state = RowState(row, vocab, logits.device)
            state = row.state
            if state.bias_ids.numel():
                logits[i].index_add_(0, state.bias_ids, state.bias_values.to(logits.dtype))
            if _holds_back_stops(row) and state.stop_ids.numel():
                logits[i, state.stop_ids] = float("-inf")
            if params.has_penalties:
                state.catch_up(row.output_ids, vocab)
                _apply_penalties(logits[i], params, state)

    @staticmethod
    def _draw(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        """Greedy rows take the argmax; each sampling row draws one uniform number from its own generator.

        A row with top-k or top-p draws among its candidates ranked by probability; a row with neither draws over
        the vocabulary in token order (no ranking needed). Either way a row's draw depends on its own logits,
        parameters and generator only, never on the other rows of the batch.
        """
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if len(sampled) < len(rows):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if not sampled:
            return chosen
        uniform = {i: torch.rand(1, generator=rows[i].generator) for i in sampled}  # one draw per row per step
        ranked = [i for i in sampled if rows[i].params.top_k > 0 or rows[i].params.top_p < 1.0]
        unranked = [i for i in sampled if i not in set(ranked)]
        for group, draw in ((ranked, _draw_ranked), (unranked, _draw_unranked)):
            if group:
                index = torch.tensor(group, device=logits.device)
                params = [rows[i].params for i in group]
                temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
                u = torch.cat([uniform[i] for i in group]).to(logits.device)
                selected = logits if len(group) == len(rows) else logits.index_select(0, index)
                chosen[index] = draw(selected / temperature, params, u)
        return chosen


def _adjusts(row: SamplerRow) -> bool:
    params = row.params
    return bool(params.logit_bias) or params.has_penalties or (_holds_back_stops(row) and bool(row.stop_token_ids))


def _holds_back_stops(row: SamplerRow) -> bool:
    """min_tokens keeps the stop tokens out, unless a grammar rules the row: a finished answer must end."""
    return len(row.output_ids) < row.params.min_tokens and row.constraint is None


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the first position whose cumulative mass exceeds u x the row's kept mass."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)


def _min_p(probs: torch.Tensor, params: list[SamplingParams], top: torch.Tensor) -> torch.Tensor:
    if not any(p.min_p for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], device=probs.device).unsqueeze(1)
    return probs.masked_fill(probs < min_p * top, 0.0)


def _draw_unranked(scaled: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows without top-k or top-p: the softmax over the vocabulary, min-p applied, drawn in token order."""
    probs = scaled.softmax(dim=-1)
    probs = _min_p(probs, params, probs.amax(dim=-1, keepdim=True))
    return _pick(probs, u).squeeze(1)


def _draw_ranked(scaled: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows with top-k or top-p: the best candidates in order of probability, then top-k, top-p and min-p.

    Only as many candidates as the rows need are ranked (`topk`, not a sort of the vocabulary): a top-k row needs
    its k; a top-p row without top-k needs `TOP_P_CANDIDATES` if they hold at least `top_p` of its mass, else all.
    """
    vocab = scaled.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    log_norm = scaled.logsumexp(dim=-1, keepdim=True)  # the whole vocabulary's, for rows without top-k
    top_p = torch.tensor([p.top_p for p in params], device=scaled.device).unsqueeze(1)
    by_k = torch.tensor([k > 0 for k in top_k], device=scaled.device).unsqueeze(1)
    widths = [*TOP_P_CANDIDATES, vocab] if any(k == 0 for k in top_k) else [0]  # top-k rows only: their largest k
    for candidates in widths:
        width = min(max([*top_k, candidates]), vocab)
        values, ids = scaled.topk(width, dim=-1)
        # The candidates' mass, summed as the top-p cut below sums it (a cumulative sum, in rank order).
        mass = (values - log_norm).exp().cumsum(dim=-1)[:, -1:]
        if width == vocab or bool((by_k | (mass >= top_p)).all()):
            break  # every top-p row's mass is within the candidates
    rank = torch.arange(width, device=scaled.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else width for kk in top_k], device=scaled.device).unsqueeze(1)
    values = values.masked_fill(rank >= k, float("-inf"))
    # A top-k row's probabilities are renormalised over its k candidates; the others' over the whole vocabulary.
    probs = (values - torch.where(by_k, values.logsumexp(dim=-1, keepdim=True), log_norm)).exp()
    # Keep a candidate while the mass before it is below top_p (the first always stays).
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    probs = _min_p(probs, params, probs[:, :1])
    return ids.gather(1, _pick(probs, u)).squeeze(1)


def _apply_penalties(row_logits: torch.Tensor, params: SamplingParams, state: RowState) -> None:
    if state.seen is not None:
        penalty = params.repetition_penalty
        penalised = torch.where(row_logits > 0, row_logits / penalty, row_logits * penalty)
        row_logits.copy_(torch.where(state.seen, penalised, row_logits))
    if state.counts is not None and state.counted:
        counts = state.counts.to(row_logits.dtype)
        row_logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row_logits.dtype)
