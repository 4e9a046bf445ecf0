"""How the engine speculates (`--speculative-config`, validated by the settings): n-gram prompt lookup."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram prompt lookup: the last `prompt_lookup_max` .. `prompt_lookup_min` tokens of a row are looked up in its
    prompt and output so far, and up to `num_speculative_tokens` tokens that followed them are proposed.

    `disable_by_batch_size`: a step with more running rows than this does not speculate (None: any batch does).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
