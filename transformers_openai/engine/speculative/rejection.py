"""Verification of draft tokens against the target model's logits, keeping the target's distribution exactly.

A row fed its last token and a draft `d1..dm` gets logits at m+1 positions: position i predicts the token after
`d_i` (position 0, the token after the fed one). Greedy rows accept a draft token while it equals the argmax, then
emit the argmax: the output is the one decoding without a draft gives. Sampling rows take the rule for a point-mass
draft (an n-gram proposal): accept `d_{i+1}` with probability p_i(d_{i+1}); on rejection draw from p_i with that
token removed and renormalised, which makes the emitted token distributed as p_i. A draft accepted whole earns one
more token, drawn from p_m. Each row draws its uniform numbers from its own generator.

Only the rules that are the same at every position apply here (logit bias, temperature, top-k, top-p, min-p); rows
with rules that depend on the tokens before (grammars, penalties, min_tokens, logprobs) do not speculate.
"""

from __future__ import annotations

import torch

from transformers_openai.engine.sampler import SamplerRow


def verify_greedy(logits: list[torch.Tensor], drafts: list[list[int]], rows: list[SamplerRow]) -> list[list[int]]:
    """The tokens each greedy row emits: its accepted draft tokens, then the argmax after them. `logits[r]` is
    `[len(drafts[r]) + 1, vocab]`."""
    biased = [_biased(row_logits, row) for row_logits, row in zip(logits, rows, strict=True)]
    best = torch.cat(biased).argmax(dim=-1).tolist()
    emitted: list[list[int]] = []
    start = 0
    for draft in drafts:
        targets = best[start : start + len(draft) + 1]
        start += len(draft) + 1
        accepted = 0
        while accepted < len(draft) and draft[accepted] == targets[accepted]:
            accepted += 1
        emitted.append([*draft[:accepted], targets[accepted]])
    return emitted


def verify_sampled(logits: torch.Tensor, draft: list[int], row: SamplerRow) -> list[int]:
    """The tokens a sampling row emits (see the module docstring); `logits` `[len(draft) + 1, vocab]`."""
    probs = target_probs(_biased(logits, row), row)
    generator = row.generator
    emitted: list[int] = []
    for i, token in enumerate(draft):
        p = probs[i]
        if float(torch.rand(1, generator=generator)) < float(p[token]):
            emitted.append(token)
            continue
        rest = p.clone()
        rest[token] = 0.0
        emitted.append(_draw(rest, generator))
        return emitted
    emitted.append(_draw(probs[len(draft)], generator))
    return emitted


def target_probs(logits: torch.Tensor, row: SamplerRow) -> torch.Tensor:
    """The distribution the sampler draws from at each position `[positions, vocab]` (unnormalised: each row's
    kept mass), as `Sampler` computes it: temperature, then top-k, top-p and min-p."""
    params = row.params
    probs = (logits.float() / params.temperature).softmax(dim=-1)
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = probs.topk(params.top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        # Keep a candidate while the mass before it is below top_p (the first always stays).
        dropped = ranked.cumsum(dim=-1) - ranked >= params.top_p
        probs = probs.scatter(1, order, ranked.masked_fill(dropped, 0.0))
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _biased(logits: torch.Tensor, row: SamplerRow) -> torch.Tensor:
    bias = row.params.logit_bias
    if not bias:
        return logits
    vocab = logits.shape[-1]
    ids = [t for t in bias if 0 <= t < vocab]
    out = logits.float().clone()
    out[:, ids] += torch.tensor([bias[t] for t in ids], dtype=out.dtype, device=out.device)
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """An inverse-CDF draw from unnormalised `probs` `[vocab]`."""
    cdf = probs.cumsum(dim=0)
    total = cdf[-1]
    target = torch.minimum(torch.rand(1, generator=generator).to(cdf.device) * total, torch.nextafter(total, 0 * total))
    return int(torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[0] - 1))
