"""The seam between the engine and a model kind (decoder-only, encoder-decoder, speech)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from transformers_openai.runners.kv.block_table import BlockTable


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
    # The request's block table, given by the engine's K/V manager at admission and held until the request leaves
    # (its row released, or the job discarded); the runner writes the K/V of new tokens at its `length`.
    kv: BlockTable | None = None

    @property
    def remaining(self) -> int:
        return len(self.prompt_token_ids) - self.done

    @property
    def table(self) -> BlockTable:
        """Its block table, which a prefill needs (the engine's K/V manager reserves it at admission)."""
        if self.kv is None:
            raise RuntimeError("a prefill needs the block table the engine's K/V manager reserves for it")
        return self.kv


@dataclass(frozen=True)
class KVPoolSpec:
    """What the engine's K/V manager needs to know of a runner's paged pool: `num_blocks` blocks (block 0 never
    handed out) of `block_size` tokens; whether full blocks may be shared by prompts that start alike."""

    num_blocks: int
    block_size: int
    shared_prefixes: bool = True

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def token_capacity(self) -> int:
        """The most tokens one request can ever hold."""
        return self.usable * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


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


DecodeRows = Mapping[int, tuple[BlockTable, int]]  # slot -> (the row's block table, its last sampled token)


class ModelRunner(Protocol):
    """Runs one model over a batch of rows, each row one request's KV state.

    A row is named by a stable `slot` id from `prefill` until `release`. The engine's K/V manager owns the pool's
    blocks: it gives each job its block table before its prefill (`PrefillJob.kv`), grows the tables before a
    decode step and records what a step wrote; the runner only reads and writes K/V where the tables say. The
    engine calls these from one thread only.
    """

    max_rows: int
    max_model_len: int
    kv_pool: KVPoolSpec  # the paged pool the engine's K/V manager hands out
    # The model kind's own decoding rules (e.g. Whisper's timestamp rules), applied to every step's logits.
    logits_processors: Sequence[LogitsProcessor]

    def output_limit(self, prompt_len: int) -> int:
        """Most tokens a request with this prompt length may generate."""
        ...

    def prefill_overhead(self, job: PrefillJob) -> int:
        """What starting this job's prefill costs beyond its tokens, in token units (0 for a decoder-only model)."""
        ...

    def decoder_prompt(self, job: PrefillJob) -> list[int]:
        """The tokens whose K/V the job's table holds once its prompt is in (a decoder-only model: the prompt; T5:
        its decoder start token first). The job needs room for them and one more token; of them, all but
        `job.remaining` are in after each `prefill`."""
        ...

    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        """Processes up to `max_tokens` more of a request's input (a runner may take all of it at once), writing its
        K/V from `job.kv.length` on and advancing `job.done`.

        Returns:
            None while input remains; once it is all in, (slot of its fresh row, next-token logits [vocab]).
        """
        ...

    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        """`prefill` for every (job, max_tokens) admitted in one step, so a runner can batch them (one encoder
        call for several windows). A job that fails gets its exception in its place; the others go on."""
        ...

    def discard(self, job: PrefillJob) -> None:
        """Drops what the runner keeps for a job that never got a row (its partial prefill)."""
        ...

    def decode(self, rows: DecodeRows) -> tuple[list[int], torch.Tensor]:
        """One step over every row, feeding each row its last sampled token at its table's `length`.

        Args:
            rows: one entry for every row in use (each table with room for one more token).
        Returns:
            (slots in the order of the logits' rows, logits of shape [rows, vocab]).
        """
        ...

    def probe(self, rows: DecodeRows) -> None:
        """Runs `decode`'s step for some rows only and keeps nothing of it; raises what `decode` would for them.

        The engine calls it after a failed `decode` to find the rows that cause the failure.
        """
        ...

    def release(self, slot: int) -> None:
        """Frees a row at once (what the runner keeps for it; its blocks are the K/V manager's); its slot may be
        reused by the next prefill."""
        ...

    def rows_in_use(self) -> int: ...
