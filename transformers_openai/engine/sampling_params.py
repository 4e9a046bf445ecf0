"""Per-request generation parameters, as the engine understands them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated. `temperature == 0` means greedy.

    `top_k <= 0` disables top-k; `seed=None` draws a fresh random seed.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # also score the prompt: each token's logprob and this many alternatives
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    speculative: bool = True  # may be decoded speculatively (when the server speculates); False opts out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
