"""Per-request state while it waits and while it runs."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import torch

from transformers_openai.engine.detokenizer import Decoder, IncrementalDetokenizer
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.engine.request import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from transformers_openai.engine.sampler import SamplerRow
from transformers_openai.engine.stats import FinishedRequest
from transformers_openai.engine.stop_matcher import StopAutomata, StopMatcher


class Sequence:
    """One request inside the engine: its row, tokens, text state and timings."""

    def __init__(
        self,
        request: EngineRequest,
        tokenizer: Decoder,
        stop_token_ids: frozenset[int],
        max_total_len: int,
        stop_automata: StopAutomata | None = None,
        decoder_prompt_of: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.request = request
        # What the decoder reads of a prompt (the runner's spec: T5 reads its start token first).
        self._decoder_prompt_of = decoder_prompt_of
        self.prefill = self._job(request.prompt_token_ids, prompt_logprobs=request.params.prompt_logprobs)
        self.slot: int | None = None  # its row, from its admission until it leaves
        self.preemptions = 0
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        params = request.params
        generator = torch.Generator()
        # Unseeded requests draw a fresh seed without touching torch's global generator.
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        # Only the decoder's prompt precedes the generated text (penalties, detokenizer context); an encoder's
        # input does not.
        decoder_prompt = request.prompt_token_ids
        self.sampler_row = SamplerRow(
            params=params,
            generator=generator,
            prompt_ids=decoder_prompt,
            output_ids=self.output_ids,
            stop_token_ids=stop_token_ids,
            constraint=request.constraint,
        )
        self._eos = frozenset() if params.ignore_eos else stop_token_ids
        self._max_tokens = min(params.max_tokens, max_total_len)
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, context=decoder_prompt)
        self._stop = StopMatcher(params.stop, stop_automata)
        self.last_gap_s: float | None = None
        self.arrival = time.monotonic()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_tokens

    @property
    def remaining_tokens(self) -> int:
        """The most tokens it may still generate."""
        return max(0, self._max_tokens - len(self.output_ids))

    def preempt(self) -> None:
        """Its row was taken back: it will be prefilled again, over its prompt and the tokens it has so far."""
        earlier, request = self.prefill, self.request
        if self.output_ids:  # its prompt was scored already, and reported with its first token
            self.prefill = self._job([*request.prompt_token_ids, *self.output_ids], info=earlier.info)
        else:  # taken back mid-prefill: it starts over, prompt scoring included
            self.prefill = self._job(request.prompt_token_ids, prompt_logprobs=request.params.prompt_logprobs)
        self.slot = None
        self.preemptions += 1

    def _job(
        self, prompt: list[int], prompt_logprobs: int | None = None, info: dict[str, float] | None = None
    ) -> PrefillJob:
        decoder_prompt = prompt if self._decoder_prompt_of is None else self._decoder_prompt_of(prompt)
        request = self.request
        return PrefillJob(
            decoder_prompt, request.encoder_inputs, info=info or {}, prompt_logprobs=prompt_logprobs, lora=request.lora
        )

    def append(self, token_id: int, logprob: tuple[float, list[tuple[int, float]]] | None) -> RequestOutput:
        """Records a sampled token and returns the output increment it produces."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_gap_s = None if self.last_token_at is None else now - self.last_token_at
        self.last_token_at = now
        self.output_ids.append(token_id)
        constraint = self.request.constraint
        if constraint is not None:
            constraint.advance(token_id)
        is_eos = token_id in self._eos  # the sampler keeps these out until min_tokens is reached
        text = "" if is_eos else self._stop.push(self._detokenizer.push(token_id))
        if is_eos or self._stop.stopped or (constraint is not None and constraint.is_done()):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= self._max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None and not self._stop.stopped:
            text += self._stop.push(self._detokenizer.flush()) + self._stop.flush()
            if self._stop.stopped:  # a stop string completed in the held-back tail
                self.finish_reason = FinishReason.STOP
        if self.finish_reason is not None:
            self.finished_at = now
        logprobs = None
        if logprob is not None:
            logprobs = [TokenLogprob(token_id=token_id, logprob=logprob[0], top=logprob[1])]
        return RequestOutput(
            request_id=self.request_id,
            text=text,
            token_ids=[token_id],
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.output_ids),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            info=(self.prefill.info or None) if len(self.output_ids) == 1 else None,
            prompt_logprobs=self._prompt_logprobs() if len(self.output_ids) == 1 else None,
            stop_string=self._stop.matched,
        )

    def prompt_only_output(self) -> RequestOutput:
        """The one output of a request that asked for no tokens (`max_tokens` 0: the prompt scored, no sampling)."""
        self.finish_reason = FinishReason.LENGTH
        self.finished_at = self.first_token_at = self.last_token_at = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            text="",
            token_ids=[],
            prompt_tokens=self.prompt_len,
            completion_tokens=0,
            finish_reason=self.finish_reason,
            info=self.prefill.info or None,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        if self.request.params.prompt_logprobs is None:
            return None
        prompt = self.request.prompt_token_ids
        scored: list[TokenLogprob | None] = [None]  # the first token: nothing before it predicts it
        for token_id, (logprob, rank, top) in zip(prompt[1:], self.prefill.prompt_scores, strict=True):
            scored.append(TokenLogprob(token_id=token_id, logprob=logprob, top=top, rank=rank))
        return scored

    def stats(self, aborted: bool = False) -> FinishedRequest:
        end = self.finished_at or time.monotonic()
        first = self.first_token_at
        decode_time = end - first if first is not None else 0.0
        return FinishedRequest(
            request_id=self.request_id,
            finish_reason=self.finish_reason.value if self.finish_reason else "unknown",
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.output_ids),
            queue_time_s=(self.scheduled_at or end) - self.arrival,
            time_to_first_token_s=None if first is None else first - self.arrival,
            e2e_latency_s=end - self.arrival,
            decode_tokens_per_s=(len(self.output_ids) - 1) / decode_time if decode_time > 0 else 0.0,
            aborted=aborted,
        )

    def final_output(self, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """The closing output of a request ended from outside (aborted or failed)."""
        self.finish_reason = reason
        self.finished_at = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            text="",
            token_ids=[],
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.output_ids),
            finish_reason=reason,
            error=error,
        )
