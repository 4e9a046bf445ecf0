"""Which prompts share a batched prefill: each prompt in one group, each group within its padding bound."""

from __future__ import annotations

import random

import pytest

from transformers_openai.runners.prefill_groups import length_groups


@pytest.mark.parametrize("max_padding", [0.0, 0.25, 1.0])
def test_groups_cover_every_prompt_once_within_the_padding_bound(max_padding: float) -> None:
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 20))]
        groups = length_groups(lengths, max_padding)
        assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
        for group in groups:
            real = sum(lengths[i] for i in group)
            assert max(lengths[i] for i in group) * len(group) <= (1 + max_padding) * real + 1e-9


def test_similar_lengths_share_one_forward_and_an_outlier_goes_apart() -> None:
    assert length_groups([50, 52, 49, 51], 0.25) == [[2, 0, 3, 1]]
    assert length_groups([50, 52, 400, 51], 0.25) == [[0, 3, 1], [2]]
    assert length_groups([10, 10, 10], 0.0) == [[0, 1, 2]]  # equal lengths need no padding
    assert length_groups([], 0.25) == []
