"""What goes into the engine (EngineRequest) and what comes out of it (RequestOutput)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.runners.lora.adapter import LoraAdapter


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorKind(str, enum.Enum):
    """Why a request ended with `FinishReason.ERROR`."""

    INTERNAL = "internal"  # a fault of the engine
    SHUTDOWN = "shutdown"  # the server is going down
    STALLED = "stalled"  # its consumer stopped taking the outputs
    CONSTRAINT = "constraint"  # its own token constraint gave up (engine.errors.ConstraintFailed)


class TokenConstraint(Protocol):
    """A rule on which tokens may come next (a grammar), advanced by every token the request samples.

    `mask` and `advance` raise `ConstraintFailed` when the rule cannot go on (e.g. its masks cost too much): only
    that request ends.
    """

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits `[vocab]` of the tokens that may not come next to -inf, in place (idempotent)."""
        ...

    def advance(self, token_id: int) -> None:
        """Records the sampled token; raises if the rule did not allow it."""
        ...

    def is_done(self) -> bool:
        """Whether the rule is complete and allows nothing more (the request ends)."""
        ...


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate.

    Args:
        request_id: unique among requests in flight.
        prompt_token_ids: the decoder's prompt, what generation continues from (a decoder-only model's prompt,
            Whisper's forced prefix; empty for T5).
        params: sampling and stopping.
        encoder_inputs: the encoder's input, opaque to the engine (T5: `input_ids`; Whisper: `input_features`);
            empty for a decoder-only model.
        continuation: the next part of a request already being served (e.g. the next 30 s window of a long
            transcription): admitted even at capacity, ahead of the queue, so a long job never gets a 429 half-way.
        priority: lower is served first (vLLM's): waiting requests are admitted by (priority, arrival), and when
            K/V memory runs out the running request with the largest (priority, arrival) is preempted first.
        lora: the adapter it is served with, held by the request itself (kept across preemption, and while it runs
            even once unloaded).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    encoder_inputs: Mapping[str, Any] = field(default_factory=dict)
    continuation: bool = False
    constraint: TokenConstraint | None = None  # which tokens may come next (structured output); this request's own
    priority: int = 0
    lora: LoraAdapter | None = None  # the LoRA adapter its rows run with (None: the base model alone)

    @property
    def prompt_tokens(self) -> int:
        """The prompt as usage counts it: the decoder's prompt and the encoder's input tokens."""
        return len(self.prompt_token_ids) + len(self.encoder_inputs.get("input_ids", ()))


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` most likely alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # of the token in its distribution, 1 = likeliest (prompt tokens only)


@dataclass
class RequestOutput:
    """An increment of one request's output. The last one has `finish_reason` set.

    `text` is the new, stop-safe text; `token_ids` the tokens sampled since the previous output.
    """

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind = ErrorKind.INTERNAL
    info: Mapping[str, float] | None = None  # what the runner learned at prefill (e.g. no_speech_prob), once
    # With `prompt_logprobs`: one entry per prompt token, None for the first (nothing predicts it), once.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_string: str | None = None  # the stop string that ended it (finish_reason STOP), cut from the text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
