"""The batched Whisper rules give the same masks as transformers' own logits processors, row by row."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor
from transformers.generation.logits_process import (
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)

from transformers_openai.runners.whisper_rules import WhisperRules, WhisperRuleTokens

VOCAB = 200
EOT, SOT, NO_TIMESTAMPS = 100, 101, 110
BEGIN = NO_TIMESTAMPS + 1  # timestamps 111..199
TOKENS = WhisperRuleTokens(
    eot=EOT,
    no_timestamps=NO_TIMESTAMPS,
    suppress=(3, 5, SOT, 105),
    begin_suppress=(7, EOT),
    max_initial_timestamp_index=10,
)
PREFIX = [SOT]


@dataclass
class Row:
    prompt_ids: list[int]
    output_ids: list[int]


def hf_processors() -> list[LogitsProcessor]:
    config = GenerationConfig(
        no_timestamps_token_id=NO_TIMESTAMPS,
        eos_token_id=EOT,
        max_initial_timestamp_index=10,
    )
    begin = len(PREFIX)
    return [
        SuppressTokensAtBeginLogitsProcessor(list(TOKENS.begin_suppress), begin_index=begin),
        SuppressTokensLogitsProcessor(list(TOKENS.suppress)),
        WhisperTimeStampLogitsProcessor(config, begin_index=begin),
    ]


def history(rng: random.Random) -> list[int]:
    """A plausible sampled history: text and timestamp tokens, timestamps in pairs and going up."""
    out: list[int] = []
    stamp = BEGIN
    for _ in range(rng.randrange(0, 12)):
        if rng.random() < 0.35:
            stamp = min(VOCAB - 1, stamp + rng.randrange(0, 6))
            out.append(stamp)
        else:
            out.append(rng.randrange(0, EOT))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_masks_equal_transformers_processors(seed: int) -> None:
    rng = random.Random(seed)
    rows = [Row(PREFIX, history(rng)) for _ in range(6)] + [Row(PREFIX, [])]
    torch.manual_seed(seed)
    # Some rows get a peaked timestamp distribution, so the "timestamp mass beats text" rule fires too.
    logits = torch.randn(len(rows), VOCAB) * 3
    logits[::2, BEGIN:] += 2.5
    ours = logits.clone()
    WhisperRules(TOKENS, VOCAB)(ours, rows)
    for i, row in enumerate(rows):
        expected = logits[i : i + 1].clone()
        ids = torch.tensor([PREFIX + row.output_ids])
        for processor in hf_processors():
            expected = processor(ids, expected)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(expected[0])), f"row {i}: {row.output_ids}"
        finite = ~torch.isinf(expected[0])
        torch.testing.assert_close(ours[i][finite], expected[0][finite])


def test_rows_without_timestamps_only_get_the_suppression() -> None:
    rows = [Row([SOT, NO_TIMESTAMPS], []), Row([SOT, NO_TIMESTAMPS], [4, 9])]
    logits = torch.zeros(2, VOCAB)
    WhisperRules(TOKENS, VOCAB)(logits, rows)
    banned = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in logits]
    assert banned[0] == set(TOKENS.suppress) | set(TOKENS.begin_suppress)
    assert banned[1] == set(TOKENS.suppress)


def test_first_token_is_an_early_timestamp_and_pairs_close() -> None:
    rules = WhisperRules(TOKENS, VOCAB)
    first = torch.zeros(1, VOCAB)
    rules(first, [Row(PREFIX, [])])
    allowed = torch.nonzero(~torch.isinf(first[0])).flatten().tolist()
    assert allowed == list(range(BEGIN, BEGIN + 11))
    after_text = torch.zeros(1, VOCAB)
    after_text[0, :BEGIN] = 10.0  # text likelier than all timestamps together: the mass rule stays out of it
    rules(after_text, [Row(PREFIX, [BEGIN + 3, 42, BEGIN + 8])])  # an open segment just closed: timestamp or end
    allowed_after = set(torch.nonzero(~torch.isinf(after_text[0])).flatten().tolist())
    # OpenAI bans the text below end of text only; the suppressed control tokens stay banned.
    specials = set(range(EOT, NO_TIMESTAMPS)) - set(TOKENS.suppress)
    assert allowed_after == specials | set(range(BEGIN + 8, VOCAB))
