"""A request's prompt on its way into its row: the engine's record of it, and the rows it describes to the runner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from transformers_openai.runners.base import PrefillRow
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.lora.adapter import LoraAdapter

# A scored prompt goes in in chunks of at most this many tokens, so the logits of all its positions stay small.
SCORED_CHUNK_TOKENS = 512

PromptScore = tuple[float, int, list[tuple[int, float]]]  # (logprob, rank, [(token, logprob)] top)


@dataclass
class PrefillJob:
    """The engine's record of a prompt going in, possibly over several steps (chunked prefill).

    `decoder_prompt` is what the request's block table holds once it is in (a decoder-only model: the prompt; T5: its
    start token first; Whisper: the forced prefix); `encoder_inputs` is the encoder's input (T5: `input_ids`;
    Whisper: `input_features`), empty for a decoder-only model.
    """

    decoder_prompt: list[int]
    encoder_inputs: Mapping[str, Any] = field(default_factory=dict)
    done: int = 0  # tokens of `decoder_prompt` in the table (a cached prefix, earlier chunks)
    info: dict[str, float] = field(default_factory=dict)  # what the runner learned while prefilling (reported once)
    # What starting this prefill costs beyond its tokens, in prompt-token units (an encoder pass), as the runner
    # declares it: the scheduler's per-step prefill budget counts it.
    overhead: int = 0
    # Prompt scoring, when asked for (`prompt_logprobs` alternatives per position): the score of every prompt token
    # after the first, in order, across chunks.
    prompt_logprobs: int | None = None
    prompt_scores: list[PromptScore] = field(default_factory=list)
    # The request's block table, given by the engine's K/V manager at admission and held until the request leaves.
    kv: BlockTable | None = None
    lora: LoraAdapter | None = None  # the request's LoRA adapter: its rows run with it, its blocks are its own

    @property
    def remaining(self) -> int:
        return len(self.decoder_prompt) - self.done

    @property
    def table(self) -> BlockTable:
        """Its block table, which a prefill needs (the engine's K/V manager reserves it at admission)."""
        if self.kv is None:
            raise RuntimeError("a prefill needs the block table the engine's K/V manager reserves for it")
        return self.kv

    def next_row(self, slot: int, budget: int, whole: bool) -> PrefillRow:
        """This step's part of the prompt: up to `budget` tokens (all that remain when the runner takes prompts
        `whole`; at most `SCORED_CHUNK_TOKENS` when scored), for the row at `slot`."""
        scoring = self.prompt_logprobs is not None
        take = self.remaining if whole else max(budget, 1)
        if scoring and not whole:
            take = min(take, SCORED_CHUNK_TOKENS)
        start, end = self.done, min(len(self.decoder_prompt), self.done + take)
        tokens = self.decoder_prompt[start:end]
        last = end == len(self.decoder_prompt)
        prompt = self.decoder_prompt
        return PrefillRow(slot, self.table, tokens, last, scoring, self.encoder_inputs, prompt, self.lora)

    def took(self, row: PrefillRow, logits: torch.Tensor | None, info: Mapping[str, float]) -> torch.Tensor | None:
        """Records a row the runner executed; returns the next-token logits `[vocab]` once the prompt is all in."""
        start = self.done
        self.done += len(row.tokens)
        self.info.update(info)
        if logits is None:
            return None
        if row.score:
            self._score(logits, start, self.done)
        return logits[-1].float() if row.last else None

    def _score(self, logits: torch.Tensor, start: int, end: int) -> None:
        """Appends the logprobs of the prompt tokens the chunk `start..end` predicts (start+1 .. end, in the prompt)."""
        targets = self.decoder_prompt[start + 1 : end + 1]
        if not targets:
            return
        logprobs = logits[: len(targets)].float().log_softmax(dim=-1)
        picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
        chosen = picked[:, 0].tolist()
        ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()
        k = self.prompt_logprobs or 0
        if k:
            values, indices = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        else:
            tops = [[] for _ in targets]
        self.prompt_scores.extend(zip(chosen, ranks, tops, strict=True))
