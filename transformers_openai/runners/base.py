"""The seam between the engine and a model kind (decoder-only, encoder-decoder, speech).

The engine describes each step (`Step`: rows named by slot, each with its block table and what it adds) and a
runner executes it (`ModelRunner.execute`); a runner keeps nothing of a request beyond its row's own state, which
`release` frees. What a kind is (its rows, context, pool and decoding rules) is its `RunnerSpec`, fixed once built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from numpy.typing import NDArray

from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.lora.layers import LoraWeightsLike

if TYPE_CHECKING:  # the engine imports this module: not the model code behind the executors
    from transformers_openai.runners.steps.paged_step import StepExecutor

# The decode step a CPU server runs: eager while its compiled step is made in the background ("compiling") and once
# made until the next step swaps it in ("ready"), then "compiled"; or "eager" for good (no compile, or it failed).
DecodeStep = Literal["compiling", "ready", "compiled", "eager"]


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


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner is, as the engine plans with it: at most `max_rows` rows of at most `max_model_len` tokens
    each (prompt and output) in its paged pool `kv_pool`, and the kind's own decoding rules.

    `decoder_start`: a token the decoder reads before the request's prompt (T5's start token), else None.
    `whole_prompt`: the prompt goes in in one step, whatever the step's budget (an encoder reads its input at once).
    """

    max_rows: int
    max_model_len: int
    kv_pool: KVPoolSpec
    logits_processors: Sequence[LogitsProcessor] = ()
    decoder_start: int | None = None
    whole_prompt: bool = False

    def decoder_prompt(self, prompt: list[int]) -> list[int]:
        """The tokens whose K/V a request's table holds once its prompt is in."""
        return prompt if self.decoder_start is None else [self.decoder_start, *prompt]

    def output_limit(self, prompt_len: int) -> int:
        """Most tokens a request with this prompt length may generate."""
        return self.max_model_len - prompt_len


@dataclass(frozen=True)
class PrefillRow:
    """A request's prompt going in: `tokens` added to its row at `slot` from `table.length` on.

    `last`: the prompt is all in after this step; `score`: the logits of every position are wanted (prompt
    logprobs); `encoder_inputs`: the request's encoder input (T5: `input_ids`; Whisper: `input_features` and
    maybe its `window`; a vision-language model: its processor's image tensors); `prompt`: the whole prompt `tokens`
    are part of (`tokens` start at its position `table.length`), for a runner that reads beyond the chunk (which of
    its image features a chunk cut inside an image takes).
    """

    slot: int
    table: BlockTable
    tokens: list[int]
    last: bool = True
    score: bool = False
    encoder_inputs: Mapping[str, Any] = field(default_factory=dict)
    prompt: Sequence[int] = ()
    lora: LoraWeightsLike | None = None  # the row's LoRA adapter, None for the base model alone


@dataclass(frozen=True)
class DecodeRow:
    """A running row fed its last sampled `token` at its table's `length`, then its `draft` tokens (speculative
    decoding: the logits of every position are returned); the table has room for them all."""

    slot: int
    table: BlockTable
    token: int
    draft: tuple[int, ...] = ()
    lora: LoraWeightsLike | None = None  # the row's LoRA adapter, None for the base model alone


@dataclass(frozen=True)
class Step:
    """One forward's work: prompts going in, then running rows advancing by one token each.

    A `probe` runs the decode rows for their failures only: nothing of it is kept or returned.
    """

    prefills: Sequence[PrefillRow] = ()
    decodes: Sequence[DecodeRow] = ()
    probe: bool = False


@dataclass(frozen=True)
class PrefillOutput:
    """A prefill row's result. `logits` `[positions, vocab]`: every position of a scored row, the last one of a row
    whose prompt is in, else None; `info`: what the runner learned (e.g. Whisper's no-speech probability)."""

    logits: torch.Tensor | None
    info: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutput:
    """A step's results: one per prefill row, in order (an exception for a row that failed alone, the others going
    on); the decode rows' next-token logits in the order of `slots`, `[positions, vocab]`: one position a row, or
    with drafts 1 + len(draft) consecutive positions a row (each draft token's, after the fed token's)."""

    prefills: Sequence[PrefillOutput | Exception] = ()
    slots: Sequence[int] = ()
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class Acceleration:
    """What a runner may set up before it serves, as the loader allows it: CUDA graphs (`graphs`), decode steps
    compiled by torch.compile (`compiled`), kernels reading the pool in place (`kernels`), kept in `store` between
    starts; `distribute` wraps its step executor to run every step on all tensor-parallel ranks. With
    `compile_elsewhere` (compiles this model's steps into `store` in another process, returning when done), the
    compiled steps are made ready in the background and swapped in while eager steps serve; `on_compiled` is told
    each change of the decode step in use (`DecodeStep`)."""

    graphs: bool = False
    compiled: bool = False
    kernels: bool = False
    store: Path | None = None
    distribute: Callable[[StepExecutor], StepExecutor] | None = None
    compile_elsewhere: Callable[[], None] | None = None
    on_compiled: Callable[[DecodeStep], None] | None = None


@dataclass(frozen=True)
class Prepared:
    """What `prepare` set up (named, for the start-up log), and whether steps run asynchronously on the device, so
    the engine may launch the next decode step before reading the last (`engine/core.py`)."""

    done: tuple[str, ...] = ()
    asynchronous: bool = False


class ModelRunner(Protocol):
    """Runs one model over rows, each row one request's K/V state, named by a slot the engine gives it.

    The engine's K/V manager owns the pool's blocks: it gives each request its block table, grows the tables before
    a decode step and records what a step wrote; the runner reads and writes K/V where the tables say. The engine
    calls these from one thread only.
    """

    spec: RunnerSpec

    def prepare(self, acceleration: Acceleration) -> Prepared:
        """Sets up what `acceleration` allows, before any row (what does not apply, or fails, is left out)."""
        ...

    def prefill_cost(self, encoder_inputs: Mapping[str, Any]) -> int:
        """What starting a prefill costs beyond its tokens, in prompt-token units (an encoder pass; 0 for none):
        the scheduler's per-step prefill budget counts it."""
        ...

    def execute(self, step: Step) -> StepOutput:
        """Runs the step: each prefill row's tokens into its row, then one token for every decode row."""
        ...

    def release(self, slot: int) -> None:
        """Frees what the runner keeps for the row at `slot` (its blocks are the K/V manager's); the slot may be
        given to another request next."""
        ...


Features = torch.Tensor | NDArray[Any]  # log-mel features `[n_mels, frames]`


class SpeechRunner(Protocol):
    """What a speech model does outside the batch, between steps, for the transcription endpoints."""

    def detect_language(
        self,
        features: Features,
        sot: int,
        language_tokens: Sequence[int],
        window: tuple[str, int] | None = None,
        lora: LoraWeightsLike | None = None,
    ) -> int: ...

    def alignment_weights(
        self, features: Features, tokens: list[int], lora: LoraWeightsLike | None = None
    ) -> torch.Tensor: ...

    def release_windows(self, key: str) -> None: ...
