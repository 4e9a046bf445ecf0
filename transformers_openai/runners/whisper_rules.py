"""Whisper's decoding rules as one logits processor over the whole batch: masks over `[rows, vocab]`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from transformers_openai.runners.base import RowTokens

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class WhisperRuleTokens:
    """The token ids the rules need."""

    eot: int
    no_timestamps: int
    suppress: tuple[int, ...]  # never sampled: non-speech symbols and the control tokens
    begin_suppress: tuple[int, ...]  # not at a window's first sampled position (the space, end of text)
    max_initial_timestamp_index: int | None = 50  # the first timestamp at most 1.00 s

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1


class WhisperRules:
    """Begin-suppress, suppress and the timestamp rules of OpenAI's decoder, in that order, for every row at once.

    Each row's state is read from its tokens: its prompt is the window's forced prefix (a row decodes with
    timestamps unless the prefix holds `<|notimestamps|>`), its output the tokens sampled so far. The rules:
    - at the first sampled position, no space and no end of text;
    - never the `suppress` tokens, nor `<|notimestamps|>` in timestamp mode;
    - timestamps come in pairs: after one timestamp, a timestamp or the end; after two, text;
    - timestamps never go down: strictly up after text, equal allowed right after a closing one;
    - the first sampled token is a timestamp, at most `max_initial_timestamp_index`;
    - when the timestamps' summed probability beats the best text token's, only timestamps remain.
    """

    def __init__(self, tokens: WhisperRuleTokens, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.tokens = tokens
        self._vocab = torch.arange(vocab_size, device=device)
        self._suppress = _index(tokens.suppress, device)
        self._begin_suppress = _index(tokens.begin_suppress, device)

    def __call__(self, logits: torch.Tensor, rows: Sequence[RowTokens]) -> None:
        if not rows:
            return
        first = [not row.output_ids for row in rows]
        self._apply_suppress(logits, first)
        timed = [i for i, row in enumerate(rows) if self.tokens.no_timestamps not in row.prompt_ids]
        if timed:
            sub = logits[timed]
            self._apply_timestamp_rules(sub, [rows[i].output_ids for i in timed])
            logits[timed] = sub

    def _apply_suppress(self, logits: torch.Tensor, first: list[bool]) -> None:
        if any(first) and self._begin_suppress.numel():
            at_begin = torch.tensor(first, device=logits.device)
            logits[:, self._begin_suppress] = logits[:, self._begin_suppress].masked_fill(at_begin[:, None], _NEG_INF)
        if self._suppress.numel():
            logits[:, self._suppress] = _NEG_INF

    def _apply_timestamp_rules(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]]) -> None:
        """The rules of timestamp mode, in place on `[rows, vocab]` logits whose rows sampled `outputs` so far."""
        begin, eot = self.tokens.timestamp_begin, self.tokens.eot
        vocab = self._vocab[: logits.shape[-1]]
        logits[:, self.tokens.no_timestamps] = _NEG_INF
        states = [_row_state(output, begin) for output in outputs]
        device = logits.device
        only_text = torch.tensor([s.only_text for s in states], device=device)[:, None]
        no_text = torch.tensor([s.no_text for s in states], device=device)[:, None]
        floor = torch.tensor([s.floor for s in states], device=device)[:, None]
        is_timestamp = vocab >= begin
        mask = (only_text & is_timestamp) | (no_text & (vocab < eot)) | (is_timestamp & (vocab < floor))
        first = torch.tensor([not output for output in outputs], device=device)[:, None]
        if bool(first.any()):
            initial = ~is_timestamp
            limit = self.tokens.max_initial_timestamp_index
            if limit is not None:
                initial = initial | (vocab > begin + limit)
            mask |= first & initial
        logits.masked_fill_(mask, _NEG_INF)
        # Where the timestamps together are likelier than any single text token, a timestamp it is.
        logprobs = logits.log_softmax(dim=-1)
        timestamp_mass = logprobs[:, begin:].logsumexp(dim=-1)
        best_text = logprobs[:, :begin].max(dim=-1).values
        force = (timestamp_mass > best_text)[:, None]
        logits[:, :begin] = logits[:, :begin].masked_fill(force, _NEG_INF)


@dataclass(frozen=True)
class _RowState:
    only_text: bool  # two timestamps in a row: text must follow
    no_text: bool  # one timestamp after text: a timestamp or the end must follow
    floor: int  # the smallest timestamp token allowed


def _row_state(output: Sequence[int], begin: int) -> _RowState:
    last = len(output) >= 1 and output[-1] >= begin
    penultimate = len(output) < 2 or output[-2] >= begin
    latest = next((token for token in reversed(output) if token >= begin), None)
    if latest is None:
        floor = begin
    elif last and not penultimate:
        floor = latest  # a closing timestamp may repeat the opening one of the next segment
    else:
        floor = latest + 1
    return _RowState(only_text=last and penultimate, no_text=last and not penultimate, floor=floor)


def _index(tokens: Iterable[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(sorted(set(tokens)), dtype=torch.long, device=device)
