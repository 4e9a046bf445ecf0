"""A model that knows nothing of the grammar: random logits every step, masked by the constraint, argmax taken."""

from __future__ import annotations

import torch

from transformers_openai.engine.request import TokenConstraint


def random_walk(constraint: TokenConstraint, vocab: int, seed: int, eos_id: int, eos_penalty: float = 0.0) -> list[int]:
    """The tokens drawn until the grammar is done; `eos_penalty` lowers the end token's logit (longer answers)."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(3000):
        logits = torch.randn(vocab, generator=generator) * 5
        logits[eos_id] -= eos_penalty
        constraint.mask(logits)
        token = int(logits.argmax())
        constraint.advance(token)
        tokens.append(token)
        if constraint.is_done():
            return tokens
    raise AssertionError("the grammar never finished")
