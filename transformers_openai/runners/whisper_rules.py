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
            self._apply_timestamp_rules(logits, timed, [rows[i].output_ids for i in timed])

    def _apply_suppress(self, logits: torch.Tensor, first: list[bool]) -> None:
        if any(first) and self._begin_suppress.numel():
            at_begin = torch.tensor([i for i, is_first in enumerate(first) if is_first], device=logits.device)
            logits[at_begin[:, None], self._begin_suppress] = _NEG_INF
        if self._suppress.numel():
            logits[:, self._suppress] = _NEG_INF

    def _apply_timestamp_rules(self, logits: torch.Tensor, timed: list[int], outputs: Sequence[Sequence[int]]) -> None:
        """The rules of timestamp mode, in place on the rows `timed` of `[rows, vocab]` logits.

        Each rule touches only its region of the vocabulary (text below end of text, or the timestamps), and
        only the rows it applies to, so a step costs little more than one pass over the logits.
        """
        begin, eot = self.tokens.timestamp_begin, self.tokens.eot
        device = logits.device
        logits[timed, self.tokens.no_timestamps] = _NEG_INF
        states = [_row_state(output, begin) for output in outputs]
        only_text = [row for row, state in zip(timed, states, strict=True) if state.only_text]
        no_text = [row for row, state in zip(timed, states, strict=True) if state.no_text]
        starting = [row for row, output in zip(timed, outputs, strict=True) if not output]
        if only_text:
            logits[only_text, begin:] = _NEG_INF
        if no_text:
            logits[no_text, :eot] = _NEG_INF
        floors = [(row, state.floor) for row, state in zip(timed, states, strict=True) if state.floor > begin]
        if floors:
            index = torch.tensor([row for row, _ in floors], device=device)
            floor = torch.tensor([value for _, value in floors], device=device)[:, None]
            stamps = self._vocab[begin : logits.shape[-1]]
            region = logits[index, begin:]
            logits[index, begin:] = region.masked_fill(stamps < floor, _NEG_INF)
        if starting:
            logits[starting, :begin] = _NEG_INF
            limit = self.tokens.max_initial_timestamp_index
            if limit is not None:
                logits[starting, begin + limit + 1 :] = _NEG_INF
        # Where the timestamps together are likelier than any single text token, a timestamp it is. Both sides
        # share the row's softmax normalizer, so the raw logits compare as the log-probabilities would.
        rows = torch.tensor(timed, device=device)
        selected = logits if len(timed) == logits.shape[0] else logits[rows]
        timestamp_mass = selected[:, begin:].logsumexp(dim=-1)
        best_text = selected[:, :begin].max(dim=-1).values
        forced = rows[timestamp_mass > best_text]
        if forced.numel():
            logits[forced, :begin] = _NEG_INF


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
