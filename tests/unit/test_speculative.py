"""Speculative decoding with n-gram prompt lookup (`--speculative-config`): the proposer, the acceptance rule's
distribution, greedy outputs equal to decoding without it under batching and preemption, K/V of rejected tokens
rolled back (never in the prefix cache), the per-request opt-out and the flag's validation."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.block_pool import BlockPool
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.kv_manager import KVManager
from transformers_openai.engine.request import EngineRequest
from transformers_openai.engine.sampler import Sampler, SamplerRow
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.speculative.config import SpeculativeConfig
from transformers_openai.engine.speculative.ngram import NgramProposer
from transformers_openai.engine.speculative.rejection import verify_sampled
from transformers_openai.engine.speculative.speculator import Speculator
from transformers_openai.engine.stats import NullObserver, SpecCounts, StepStats
from transformers_openai.protocol.text import ChatCompletionRequest
from transformers_openai.runners.base import KVPoolSpec
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_pool import KVSpace, self_attention_geometry
from transformers_openai.settings import Settings, SpeculativeSettings

torch.set_num_threads(1)

BLOCK = 4
# Prompts that repeat themselves, so the proposer finds drafts; the tiny model's own loops give it more.
PROMPTS = [[*range(30 + i, 36 + i)] * 3 + [7 + i] for i in range(5)] + [[5, 9, 5, 9, 5, 9, 5]]
MAX_TOKENS = [24, 17, 30, 9, 21, 26]


# ------------------------------------------------------------------------------------------------ proposer


def test_the_proposer_continues_the_latest_longest_match_within_its_limits() -> None:
    propose = NgramProposer(k=3, n_max=3, n_min=1).propose
    history = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4], dtype=np.int64)
    assert propose(history, 10) == [6, 7, 8]  # "2 3 4" last seen before 6 7 8
    assert propose(history, 2) == [6, 7]  # never past what the row may still emit
    assert propose(np.array([1, 2, 3, 7], dtype=np.int64), 5) == []  # 7 never seen before
    assert NgramProposer(k=3, n_max=3, n_min=2).propose(np.array([5, 1, 6, 1], dtype=np.int64), 5) == []
    assert propose(np.array([4, 4], dtype=np.int64), 5) == [4]


# ------------------------------------------------------------------------------------------------ acceptance rule


def _row(params: SamplingParams, seed: int) -> SamplerRow:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return SamplerRow(params, generator, [1], [], frozenset())


def _sampler_histogram(logits: torch.Tensor, params: SamplingParams, draws: int) -> np.ndarray:
    """What the plain sampler emits from `logits` `[vocab]`, as frequencies."""
    row = _row(params, 1234)
    sampler = Sampler()
    counts = Counter(sampler(logits.unsqueeze(0), [row]).token_ids[0] for _ in range(draws))
    return np.array([counts[t] for t in range(logits.shape[-1])]) / draws


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["plain", "top-k-top-p"],
)
def test_the_acceptance_rule_emits_the_target_distribution(params: SamplingParams) -> None:
    # A 6-token vocabulary; drafts [2, 3]: token 2 has about 0.3 of the first position's mass. Accepting it always,
    # or drawing again from p without removing it (0.3 + 0.7 * 0.3), would be far outside the tolerance.
    logits = torch.tensor([[1.0, 0.2, 1.6, 0.5, 1.2, -1.0], [0.3, 1.1, 0.0, 1.5, 0.2, 0.9], [0.0] * 6])
    draws = 6000
    row = _row(params, 7)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    accepted_first = 0
    for _ in range(draws):
        emitted = verify_sampled(logits, [2, 3], row)
        first[emitted[0]] += 1
        if emitted[0] == 2:  # the draft's first token accepted: the next one is drawn from position 1
            accepted_first += 1
            second[emitted[1]] += 1
    expected_first = _sampler_histogram(logits[0], params, draws)
    expected_second = _sampler_histogram(logits[1], params, draws)
    got_first = np.array([first[t] for t in range(6)]) / draws
    got_second = np.array([second[t] for t in range(6)]) / accepted_first
    assert np.abs(got_first - expected_first).max() < 0.035, (got_first, expected_first)
    assert np.abs(got_second - expected_second).max() < 0.05, (got_second, expected_second)


# ------------------------------------------------------------------------------------------------ rollback


def test_rejected_tokens_give_their_blocks_back_and_never_join_the_prefix_cache() -> None:
    kv = KVManager(KVPoolSpec(num_blocks=9, block_size=BLOCK))
    table = BlockTable()
    assert kv.pool.grow(table, 5)
    kv.written(table, [1, 2, 3, 4, 5])  # one full block (cached), one started
    free = kv.pool.available
    assert kv.room(table, 1 + 6) == 7  # the fed token and a draft of 6: up to position 11, three blocks
    assert len(table.blocks) == 3 and kv.pool.available == free - 1
    kv.written(table, [6, 7])  # the fed token and one accepted draft token; the other five were rejected
    kv.rolled_back(table)
    assert table.length == 7 and len(table.blocks) == 2 and kv.pool.available == free
    assert len(table.digests) == 1 and table.tokens == [1, 2, 3, 4, 5, 6, 7]
    # A pool short of blocks: the draft is cut to the room the table already holds, nothing is taken.
    tight = KVManager(KVPoolSpec(num_blocks=3, block_size=BLOCK))
    held = BlockTable()
    assert tight.pool.grow(held, 6)
    tight.written(held, [1, 2, 3, 4, 5])
    assert tight.room(held, 6) == 3 and len(held.blocks) == 2


def test_truncate_leaves_shared_prefix_blocks_alone() -> None:
    pool = BlockPool(8, BLOCK)
    table = BlockTable()
    assert pool.grow(table, 12)
    pool.written(table, list(range(8)))
    pool.truncate(table, 2)
    assert len(table.blocks) == 2 and pool.available == 8 - 1 - 2


# ------------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


class Steps(NullObserver):
    def __init__(self) -> None:
        self.stats: list[StepStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.stats.append(stats)

    def total(self) -> SpecCounts:
        total = SpecCounts()
        for stats in self.stats:
            if stats.spec is not None:
                total.drafts += stats.spec.drafts
                total.draft_tokens += stats.spec.draft_tokens
                total.accepted += stats.spec.accepted
        return total


def _space(model, blocks: int) -> KVSpace:
    per_token = self_attention_geometry(model).bytes_per_token
    return KVSpace(bytes=(blocks + 1) * BLOCK * per_token, block_size=BLOCK)


def _run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Every request to its end; after each step, every running row's table holds exactly its kept tokens."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add(request)
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.token_ids)
        for seq in core.scheduler.running.values():
            table = seq.prefill.kv
            assert table is not None
            kept = [*seq.request.prompt_token_ids, *seq.output_ids][:-1]
            assert table.length == len(kept) and table.tokens == kept
            assert len(table.blocks) <= -(-(table.length + 1) // BLOCK)  # nothing held past the next token
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0
    return tokens


def _core(model, tokenizer, speculative: SpeculativeConfig | None, blocks: int = 200, fixed: bool = False):
    runner = CausalLMRunner(model, max_rows=6, max_model_len=96, kv=_space(model, blocks))
    if fixed:
        assert runner.fix_steps(graphs=False, buckets=True)
    observer = Steps()
    speculator = Speculator(speculative) if speculative is not None else None
    core = EngineCore(runner, tokenizer, Scheduler(6, 16), frozenset(), observer, speculator=speculator)
    return core, observer


def _requests(**params: object) -> list[EngineRequest]:
    settings: dict[str, object] = {"temperature": 0.0, **params}
    return [
        EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=n, **settings))  # type: ignore[arg-type]
        for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]


@pytest.fixture(scope="module")
def plain_tokens(model, tokenizer) -> dict[str, list[int]]:
    core, _ = _core(model, tokenizer, None)
    return _run(core, _requests())


@pytest.mark.parametrize("fixed", [False, True], ids=["grouped-decode", "fixed-decode"])
def test_greedy_outputs_under_batching_equal_those_without_speculation(model, tokenizer, plain_tokens, fixed) -> None:
    core, observer = _core(model, tokenizer, SpeculativeConfig(num_speculative_tokens=5), fixed=fixed)
    assert _run(core, _requests()) == plain_tokens
    total = observer.total()
    # Drafts were proposed, some tokens accepted and some rejected.
    assert total.drafts > 0 and 0 < total.accepted < total.draft_tokens
    steps = sum(1 for s in observer.stats if s.batch_size)
    assert steps < max(MAX_TOKENS)  # fewer decode steps than tokens: accepted drafts saved steps


def test_a_short_pool_speculates_less_and_preempts_as_before(model, tokenizer, plain_tokens) -> None:
    core, observer = _core(model, tokenizer, SpeculativeConfig(num_speculative_tokens=5), blocks=30)
    assert _run(core, _requests()) == plain_tokens
    assert sum(s.preemptions for s in observer.stats) > 0
    assert max(s.kv.blocks_used for s in observer.stats if s.kv) <= 30


def test_a_request_that_opts_out_is_not_speculated(model, tokenizer, plain_tokens) -> None:
    core, observer = _core(model, tokenizer, SpeculativeConfig())
    assert _run(core, _requests(speculative=False)) == plain_tokens
    assert observer.total().drafts == 0


def test_rows_with_rules_on_earlier_tokens_do_not_speculate(model, tokenizer) -> None:
    core, observer = _core(model, tokenizer, SpeculativeConfig())
    requests = [
        EngineRequest("penalty", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3)),
        EngineRequest("logprobs", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)),
    ]
    _run(core, requests)
    assert observer.total().drafts == 0


def test_seeded_sampling_rows_speculate_and_repeat_with_their_seed(model, tokenizer) -> None:
    def sampled() -> dict[str, list[int]]:
        core, observer = _core(model, tokenizer, SpeculativeConfig())
        tokens = _run(core, _requests(temperature=0.3, seed=11))
        assert observer.total().accepted > 0
        return tokens

    first = sampled()
    assert first == sampled()
    assert [len(t) for t in first.values()] == MAX_TOKENS


# ------------------------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{bad", "Invalid JSON"),
        ('{"method": "eagle"}', "method: Input should be 'ngram'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens: Input should be greater than or equal to 1"),
        ('{"num_speculative_tokens": "3"}', "num_speculative_tokens: Input should be a valid integer"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "exceeds"),
        ('{"model": "small"}', 'draft "model" is not supported'),
        ('{"ngram": 1}', "ngram: Extra inputs are not permitted"),
    ],
)
def test_a_bad_speculative_config_is_refused_at_start_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(speculative_config=text)
    assert "--speculative-config" in str(caught.value) and says in str(caught.value)


def test_the_speculative_config_parses_as_vllm_spells_it() -> None:
    settings = Settings(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert settings.speculative == SpeculativeSettings(num_speculative_tokens=3, prompt_lookup_max=2)
    assert Settings().speculative is None


def test_the_opt_out_field_maps_to_the_engine_and_is_validated() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(base).to_sampling_params(8).speculative
    off = ChatCompletionRequest.model_validate({**base, "speculative_decoding": False})
    assert not off.to_sampling_params(8).speculative
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**base, "speculative_decoding": "no"})


def test_the_acceptance_counters_are_exported_as_vllm_names_them() -> None:
    from transformers_openai.metrics import Metrics

    metrics = Metrics("m")
    spec = SpecCounts(drafts=2, draft_tokens=7, accepted=4, accepted_per_pos=[2, 1, 1, 0, 0])
    metrics.on_step(StepStats(1, 0, 2, 2, 4, 0, 6, [], spec=spec))
    text = metrics.render().decode()
    for line in (
        'transformers_openai:spec_decode_num_drafts_total{model_name="m"} 2.0',
        'transformers_openai:spec_decode_num_draft_tokens_total{model_name="m"} 7.0',
        'transformers_openai:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0',
        'transformers_openai:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
    ):
        assert line in text


def test_a_row_whose_drafts_are_rejected_pauses_drafting(tokenizer) -> None:
    from transformers_openai.engine.sequence import Sequence
    from transformers_openai.engine.speculative.speculator import FIRST_PAUSE

    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3))
    seq = Sequence(
        EngineRequest("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=50, temperature=0.0)), tokenizer, frozenset(), 50
    )
    seq.output_ids.append(3)
    logits = torch.zeros(4, 8)
    logits[:, 7] = 5.0  # the target always wants token 7: every draft token is rejected
    rejected = 0
    while (draft := speculator.drafts([seq])[0]) and rejected < 10:
        assert draft == [1, 2, 3]
        speculator.verify([logits], [draft], [seq.sampler_row], SpecCounts(), ["r"])
        rejected += 1
    assert rejected == 2  # the moving average fell below the threshold after two rejected drafts
    assert [speculator.drafts([seq])[0] for _ in range(FIRST_PAUSE)] == [[]] * (FIRST_PAUSE - 1) + [[1, 2, 3]]
