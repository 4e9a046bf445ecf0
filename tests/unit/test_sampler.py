"""Sampler: greedy, seeded batch-independence, truncation, temperature, biases, min_tokens, penalties, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from transformers_openai.engine.sampler import Sampler, SampleResult, SamplerRow
from transformers_openai.engine.sampling_params import SamplingParams

torch.set_num_threads(1)

VOCAB = 32


def row(
    seed: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stop: frozenset[int] = frozenset(),
    **params: Any,
) -> SamplerRow:
    generator = torch.Generator().manual_seed(seed)
    return SamplerRow(SamplingParams(**params), generator, prompt or [], output or [], stop)


def reported(result: SampleResult, index: int) -> tuple[float, list[tuple[int, float]]]:
    """The logprobs a row that asked for them got."""
    entry = result.logprobs[index]
    assert entry is not None
    return entry


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_return_argmax() -> None:
    logits = logits_for(5)
    result = Sampler()(logits, [row(temperature=0.0) for _ in range(5)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 5


def seeded_tokens(companions: list[SamplerRow], index: int, steps: int = 25) -> list[int]:
    """The tokens drawn by a seeded row placed at `index` among `companions`, over several steps."""
    target = row(seed=1234, temperature=0.9, top_p=0.95)
    rows = companions[:index] + [target] + companions[index:]
    tokens = []
    for step in range(steps):
        logits = logits_for(len(rows), seed=step)
        logits[index] = logits_for(1, seed=1000 + step)[0]  # the target always sees the same logits
        tokens.append(Sampler()(logits, rows).token_ids[index])
    return tokens


def test_seeded_row_is_independent_of_batch() -> None:
    alone = seeded_tokens([], 0)
    assert len(set(alone)) > 1  # it really samples
    assert seeded_tokens([row(seed=7, temperature=1.5), row(temperature=0.0)], 2) == alone
    assert seeded_tokens([row(seed=8, top_k=3), row(seed=9, temperature=0.3, min_p=0.2)], 0) == alone
    assert seeded_tokens([row(temperature=0.0), row(seed=5, top_p=0.5), row(seed=6)], 1) == alone


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 0.999}])
def test_truncation_to_one_token_equals_argmax(params: dict[str, Any]) -> None:
    logits = logits_for(8, seed=3)
    rows = [row(seed=s, temperature=2.0, **params) for s in range(8)]
    for _ in range(5):
        assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def frequencies(logits: torch.Tensor, draws: int, **params: Any) -> torch.Tensor:
    """Empirical token frequencies of many rows sharing one seeded generator."""
    generator = torch.Generator().manual_seed(42)
    rows = [SamplerRow(SamplingParams(**params), generator, [], [], frozenset()) for _ in range(draws)]
    tokens = Sampler()(logits.expand(draws, -1), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / draws


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq = frequencies(logits, 4000, temperature=temperature)
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0])
    freq = frequencies(logits, 2000, top_k=2)
    assert freq[2:].sum() == 0 and freq[0] > 0 and freq[1] > 0
    probs = torch.softmax(logits, dim=-1)  # a top_p just above the first token's mass keeps exactly two
    freq = frequencies(logits, 2000, top_p=float(probs[0] + 0.01))
    assert freq[2:].sum() == 0 and freq[1] > 0


def test_min_p_is_relative_to_the_top_token() -> None:
    logits = torch.tensor([2.0, 1.8, 0.0, -0.5, -1.0])  # p1/p0 ~ 0.82, p2/p0 ~ 0.14
    freq = frequencies(logits, 2000, min_p=0.5)
    assert freq[0] > 0 and freq[1] > 0
    assert freq[2:].sum() == 0


def test_logit_bias_forces_and_forbids() -> None:
    logits = logits_for(2, seed=4)
    top = logits.argmax(dim=-1).tolist()
    forced = (top[0] + 1) % VOCAB
    rows = [row(seed=1, logit_bias={forced: 100.0}), row(temperature=0.0, logit_bias={top[1]: -100.0})]
    for _ in range(5):
        tokens = Sampler()(logits, rows).token_ids
        assert tokens[0] == forced
        assert tokens[1] != top[1]
        assert tokens[1] == logits[1].topk(2).indices[1].item()


def test_min_tokens_suppresses_stop_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # the stop token is the favourite
    logits[0, 5] = 5.0
    stop = frozenset({2})
    assert Sampler()(logits, [row(temperature=0.0, min_tokens=3, output=[7, 7], stop=stop)]).token_ids == [5]
    assert Sampler()(logits, [row(temperature=0.0, min_tokens=3, output=[7, 7, 7], stop=stop)]).token_ids == [2]
    assert Sampler()(logits, [row(seed=3, min_tokens=1, stop=stop)]).token_ids != [2]


def two_way(first: float, second: float) -> torch.Tensor:
    """Logits where token 0 narrowly beats token 1 and every other token is far behind."""
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, 0], logits[0, 1] = first, second
    return logits


@pytest.mark.parametrize(("first", "second"), [(2.0, 1.9), (-1.0, -1.1)])
def test_repetition_penalty_flips_greedy_choice(first: float, second: float) -> None:
    logits = two_way(first, second)
    assert Sampler()(logits, [row(temperature=0.0, prompt=[0])]).token_ids == [0]
    assert Sampler()(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]).token_ids == [1]
    assert Sampler()(logits, [row(temperature=0.0, output=[0], repetition_penalty=1.2)]).token_ids == [1]


def test_presence_penalty_flips_greedy_choice() -> None:
    logits = two_way(2.0, 1.9)
    assert Sampler()(logits, [row(temperature=0.0, output=[0], presence_penalty=0.5)]).token_ids == [1]
    assert Sampler()(logits, [row(temperature=0.0, output=[3], presence_penalty=0.5)]).token_ids == [0]
    logits = two_way(2.0, 1.8)  # presence counts a token once, however often it appeared
    assert Sampler()(logits, [row(temperature=0.0, output=[0, 0, 0], presence_penalty=0.1)]).token_ids == [0]


def test_frequency_penalty_grows_with_count() -> None:
    logits = two_way(2.0, 1.8)
    assert Sampler()(logits, [row(temperature=0.0, output=[0], frequency_penalty=0.1)]).token_ids == [0]
    assert Sampler()(logits, [row(temperature=0.0, output=[0, 0, 0], frequency_penalty=0.1)]).token_ids == [1]


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    logits = logits_for(3, seed=5)
    forced = 11
    rows = [
        row(temperature=0.0, logprobs=4),
        row(seed=2, logprobs=0, logit_bias={forced: 100.0}),
        row(temperature=0.0),
    ]
    result = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    chosen, top = reported(result, 0)
    assert chosen == pytest.approx(raw[0, result.token_ids[0]].item(), abs=1e-5)
    assert len(top) == 4
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True)
    assert [t for t, _ in top] == raw[0].topk(4).indices.tolist()
    assert top[0][0] == result.token_ids[0]
    assert result.token_ids[1] == forced
    chosen, top = reported(result, 1)
    assert chosen == pytest.approx(raw[1, forced].item(), abs=1e-5)  # before the bias
    assert top == []
    assert result.logprobs[2] is None


def test_model_kind_processors_rule_the_distribution_before_logprobs_and_sampling() -> None:
    banned = [3, 4, 5]
    seen_rows: list[int] = []

    def ban_some(logits: torch.Tensor, rows: Sequence[object]) -> None:
        seen_rows.append(len(rows))
        logits[:, banned] = float("-inf")

    logits = logits_for(3)
    logits[:, 4] = 50.0  # the model's favourite, but the processor bans it
    sampler = Sampler([ban_some])
    given = logits.clone()
    result = sampler(given, [row(temperature=0.0, logprobs=2), row(seed=1), row(seed=2, top_k=4)])
    assert seen_rows == [3]
    assert torch.equal(given, logits)  # the caller's logits are left as the model made them
    assert not set(result.token_ids) & set(banned)
    chosen, top = reported(result, 0)
    ruled = logits[0].clone()
    ruled[banned] = float("-inf")
    expected = torch.log_softmax(ruled, dim=-1)
    assert chosen == pytest.approx(float(expected.max()), abs=1e-5)
    assert [t for t, _ in top] == expected.topk(2).indices.tolist()


def reference_draw(scaled: torch.Tensor, params: SamplingParams, u: float) -> int:
    """Top-k, top-p and min-p over a full sort of the vocabulary, then the inverse-CDF draw: the plain definition."""
    values, ids = scaled.sort(descending=True)
    if params.top_k > 0:
        values = values.masked_fill(torch.arange(values.numel()) >= params.top_k, float("-inf"))
    probs = values.softmax(dim=-1)
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p, 0.0)
    probs = probs.masked_fill(probs < params.min_p * probs[0], 0.0)
    cdf = probs.cumsum(dim=-1)
    return int(ids[int(torch.searchsorted(cdf, u * cdf[-1], right=True))])


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 0.9},
        {"top_p": 0.5, "min_p": 0.05},
        {"top_k": 40},
        {"top_k": 700, "top_p": 0.8},
        {"top_p": 0.6, "temperature": 1.5},  # spread past the first candidates, within the second
        {"top_p": 0.999, "temperature": 3.0},  # mass spread past the first candidates: the whole vocabulary is ranked
    ],
)
def test_ranked_draws_equal_a_full_sort_on_a_large_vocabulary(params: dict[str, Any]) -> None:
    from transformers_openai.engine.sampler import TOP_P_CANDIDATES

    vocab = 6 * TOP_P_CANDIDATES[-1]
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(5)) * 4
    rows = [row(seed=s, **params) for s in range(24)]
    expected = []
    for i, r in enumerate(rows):
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(i)))
        expected.append(reference_draw(logits[i] / r.params.temperature, r.params, u))
    assert Sampler()(logits, rows).token_ids == expected
    assert len(set(expected)) > 5  # the rows really sample


def test_penalties_follow_the_tokens_as_they_come() -> None:
    """The per-row penalty state, updated one token at a time, equals penalties recomputed from the token lists."""
    prompt = [3, 5, 5]
    params: dict[str, Any] = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.7,
        "temperature": 0.0,
    }
    r = row(prompt=prompt, **params)
    output = r.output_ids  # the sequence's live list, as the engine shares it
    for step, token in enumerate([5, 9, 9, 9, 1]):
        logits = logits_for(1, seed=step)
        expected = logits[0].clone()
        seen = sorted(set(prompt + output))
        values = expected[seen]
        expected[seen] = torch.where(values > 0, values / 1.3, values * 1.3)
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
        expected -= 0.7 * counts + 0.4 * (counts > 0).float()
        adjusted = logits.clone()
        Sampler._adjust(adjusted, [r], [0])
        torch.testing.assert_close(adjusted[0], expected)
        output.append(token)


class OnlyTokens:
    """A constraint that allows a fixed set of tokens and records what it was given."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.seen: list[int] = []

    def mask(self, logits: torch.Tensor) -> None:
        keep = torch.full_like(logits, float("-inf"))
        keep[list(self.allowed)] = 0.0
        logits += keep

    def advance(self, token_id: int) -> None:
        assert token_id in self.allowed
        self.seen.append(token_id)

    def is_done(self) -> bool:
        return False


def test_constrained_rows_draw_allowed_tokens_and_free_rows_are_untouched() -> None:
    logits = logits_for(4, seed=11)
    original = logits.clone()
    free_greedy, free_sampled = row(temperature=0.0, logprobs=2), row(seed=3, temperature=1.0)
    alone = Sampler()(original.clone()[1:2], [free_sampled]).token_ids[0]
    constrained = [row(temperature=0.0, logprobs=0), row(seed=4, temperature=1.5)]
    constrained[0].constraint, constrained[1].constraint = OnlyTokens({3, 4}), OnlyTokens({7})
    result = Sampler()(logits, [free_greedy, row(seed=3, temperature=1.0), *constrained])
    assert torch.equal(logits, original)  # the model's logits are not touched (a retry starts from them)
    assert result.token_ids[0] == int(original[0].argmax())
    assert result.token_ids[1] == alone
    assert result.token_ids[2] == (3 if original[2, 3] > original[2, 4] else 4)
    assert result.token_ids[3] == 7
    # The reported logprobs are those of the constrained distribution: all mass on the allowed tokens.
    chosen, _ = reported(result, 2)
    allowed = torch.log_softmax(original[2, [3, 4]], dim=-1)
    assert chosen == pytest.approx(float(allowed.max()), abs=1e-5)


def test_a_grammar_may_end_the_answer_before_min_tokens() -> None:
    """When the grammar allows only the stop token, min_tokens does not forbid it (that would leave no token)."""
    logits = logits_for(1, seed=12)
    r = row(temperature=0.0, min_tokens=50, stop=frozenset({2}))
    r.constraint = OnlyTokens({2})
    assert Sampler()(logits, [r]).token_ids == [2]
    free = row(temperature=0.0, min_tokens=50, stop=frozenset({int(logits[0].argmax())}))
    assert Sampler()(logits, [free]).token_ids != [int(logits[0].argmax())]  # without a grammar it still holds
