"""The seam between the engine and a model kind (decoder-only, encoder-decoder, speech)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class PrefillJob:
    """A request's input on its way into a row, possibly over several engine steps (chunked prefill).

    `prompt_token_ids` is the decoder's prompt (what generation continues from; empty for T5, whose runner starts
    from the decoder start token); `encoder_inputs` is the encoder's input (T5: `input_ids`; Whisper:
    `input_features`), empty for a decoder-only model.
    """

    prompt_token_ids: list[int]
    encoder_inputs: Mapping[str, Any] = field(default_factory=dict)
    done: int = 0  # prompt tokens processed so far
    state: Any = None  # the runner's partial cache between chunks
    info: dict[str, float] = field(default_factory=dict)  # what the runner learned while prefilling (reported once)
    # What starting this prefill costs beyond its tokens, in prompt-token units (an encoder pass), as the runner
    # declares it: the scheduler's per-step prefill budget counts it.
    overhead: int = 0
    # Prompt scoring, when asked for (`prompt_logprobs` alternatives per position): the runner fills `prompt_scores`
    # with (logprob, rank, [(token, logprob)] top) of every prompt token after the first, in order, across chunks.
    prompt_logprobs: int | None = None
    prompt_scores: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)
    kv: Any = None  # the runner's K/V reservation (a block table), from admission until the row joins

    @property
    def remaining(self) -> int:
        return len(self.prompt_token_ids) - self.done


@dataclass(frozen=True)
class KVUsage:
    """The K/V pool's state: blocks held by requests (cached prefixes nobody holds count as free), and the prefix
    cache's lookups (prompt tokens looked up, and found)."""

    blocks_used: int
    blocks_total: int
    blocks_cached: int = 0  # of the free ones, those keeping a prefix for reuse
    prefix_queries: int = 0
    prefix_hits: int = 0


PrefillResult = tuple[int, torch.Tensor] | None  # (slot of the fresh row, next-token logits), or None: not all in


class OneByOnePrefill:
    """`prefill_batch` and `discard` for runners that prefill each job alone (a runner that can batch overrides)."""

    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        raise NotImplementedError

    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        outcomes: list[PrefillResult | Exception] = []
        for job, max_tokens in jobs:
            try:
                outcomes.append(self.prefill(job, max_tokens))
            except Exception as exc:  # that job's failure only
                outcomes.append(exc)
        return outcomes

    def discard(self, job: PrefillJob) -> None:
        job.state = None  # what the runner kept between chunks


class RowTokens(Protocol):
    """What a logits processor may read about one row: its prompt and the tokens sampled so far."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...


class LogitsProcessor(Protocol):
    """A model kind's decoding rule, applied in place to the whole batch's logits `[rows, vocab]` at once.

    It runs before anything else in sampling, so the reported logprobs are those of the ruled distribution.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[RowTokens]) -> None: ...


class ModelRunner(Protocol):
    """Runs one model over a batch of rows, each row one request's KV state.

    A row is named by a stable `slot` id from `prefill` until `release`. The engine calls these from
    one thread only.
    """

    max_rows: int
    max_model_len: int
    # The model kind's own decoding rules (e.g. Whisper's timestamp rules), applied to every step's logits.
    logits_processors: Sequence[LogitsProcessor]

    def output_limit(self, prompt_len: int) -> int:
        """Most tokens a request with this prompt length may generate."""
        ...

    def prefill_overhead(self, job: PrefillJob) -> int:
        """What starting this job's prefill costs beyond its tokens, in token units (0 for a decoder-only model)."""
        ...

    def reserve(self, job: PrefillJob) -> bool:
        """Sets aside the K/V memory a job about to start its prefill needs (its whole prompt and one more token),
        reusing cached blocks its prompt starts with (then `job.done` skips them). False: it does not fit now."""
        ...

    def grow(self) -> bool:
        """Makes room for one more token in every row before a decode step. False: the pool is short (the engine
        then preempts a request and asks again)."""
        ...

    def kv_usage(self) -> KVUsage: ...

    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        """Processes up to `max_tokens` more of a request's input (a runner may take all of it at once).

        Returns:
            None while input remains; once it is all in, (slot of its fresh row, next-token logits [vocab]).
        """
        ...

    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        """`prefill` for every (job, max_tokens) admitted in one step, so a runner can batch them (one encoder
        call for several windows). A job that fails gets its exception in its place; the others go on."""
        ...

    def discard(self, job: PrefillJob) -> None:
        """Drops what a job that never got a row holds (its reservation, its partial prefill)."""
        ...

    def decode(self, last_tokens: Mapping[int, int]) -> tuple[list[int], torch.Tensor]:
        """One step over every row, feeding each row its last sampled token.

        Args:
            last_tokens: slot -> token id, one entry for every row in use.
        Returns:
            (slots in the order of the logits' rows, logits of shape [rows, vocab]).
        """
        ...

    def probe(self, last_tokens: Mapping[int, int]) -> None:
        """Runs `decode`'s step for some rows only and keeps nothing of it; raises what `decode` would for them.

        The engine calls it after a failed `decode` to find the rows that cause the failure.
        """
        ...

    def release(self, slot: int) -> None:
        """Frees a row at once; its slot may be reused by the next prefill."""
        ...

    def rows_in_use(self) -> int: ...
