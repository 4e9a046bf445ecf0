"""A K/V pool too small for the batch: requests are preempted and recomputed, and every greedy output still equals
the model's own greedy decoding alone, for all three model kinds. Prefix reuse skips the cached part of a prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from tests.model_factory import build_tiny_t5, cache_root
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason, RequestOutput
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.stats import NullObserver, StepStats
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.kv_pool import KVSpace, self_attention_geometry
from transformers_openai.runners.seq2seq import Seq2SeqRunner
from transformers_openai.runners.whisper import WINDOW_FRAMES, WhisperRunner

torch.set_num_threads(1)

BLOCK = 4
NEW_TOKENS = 14


class Steps(NullObserver):
    def __init__(self) -> None:
        self.stats: list[StepStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.stats.append(stats)

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.stats)


def space(model, blocks: int, rows_reserved: int = 0, reserved_len: int = 0) -> KVSpace:
    """A budget of `blocks` blocks of self-attention K/V and the cross-attention rows an encoder-decoder sets aside."""
    per_token = self_attention_geometry(model).bytes_per_token
    return KVSpace(bytes=(blocks + 1) * BLOCK * per_token + rows_reserved * reserved_len * per_token, block_size=BLOCK)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for req in requests:
        core.add(req)
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.token_ids)
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
    return tokens


def greedy(new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)


# ------------------------------------------------------------------------------------------------ decoder-only


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def llama_reference(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


PROMPTS = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([9, 3, 14, 6, 11])]


@pytest.mark.parametrize("lookahead", [False, True], ids=["", "lookahead"])
@pytest.mark.parametrize("fixed", [False, True], ids=["grouped-decode", "fixed-decode"])
def test_decoder_rows_preempted_for_room_resume_with_the_same_greedy_tokens(
    llama, llama_tokenizer, fixed, lookahead
) -> None:
    # 5 requests of up to 14 + 14 tokens (up to 7 blocks each) in a pool of 14 blocks: they cannot all run.
    runner = CausalLMRunner(llama, max_rows=5, max_model_len=64, kv=space(llama, 14))
    if fixed:  # fixed-shape decode steps (padded to buckets, as CUDA graphs run them), where they fit the pool
        assert runner.fix_steps(graphs=False, buckets=True)
    observer = Steps()
    core = EngineCore(runner, llama_tokenizer, Scheduler(5, 16), frozenset(), observer, lookahead=lookahead)
    requests = [EngineRequest(f"r{i}", prompt, greedy()) for i, prompt in enumerate(PROMPTS)]
    tokens = run(core, requests)
    assert tokens == {r.request_id: llama_reference(llama, r.prompt_token_ids) for r in requests}
    assert observer.preemptions > 0
    assert max(s.kv.blocks_used for s in observer.stats if s.kv) <= 14
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0


def test_a_prompt_whose_start_is_cached_prefills_only_the_rest(llama, llama_tokenizer) -> None:
    runner = CausalLMRunner(llama, max_rows=2, max_model_len=64, kv=space(llama, 30))
    core = EngineCore(runner, llama_tokenizer, Scheduler(2, 16), frozenset())
    history = list(range(30, 53))  # 23 tokens: 5 full blocks of 4
    first = EngineRequest("first", history, greedy(4))
    run(core, [first])
    assert core.kv.usage().prefix_hits == 0
    turn = [*history, 7, 8, 9]
    widths: list[int] = []
    hook = llama.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        tokens = run(core, [EngineRequest("second", turn, greedy(4))])
    finally:
        hook.remove()
    usage = core.kv.usage()
    assert usage.prefix_hits == 20 and usage.prefix_queries == len(history) + len(turn)
    assert widths[0] == len(turn) - 20  # the prefill forward saw only the uncached tokens
    assert tokens["second"] == llama_reference(llama, turn, 4)
    assert usage.blocks_used == 0


def test_a_prompt_larger_than_the_pool_fails_alone(llama, llama_tokenizer) -> None:
    runner = CausalLMRunner(llama, max_rows=2, max_model_len=512, kv=space(llama, 6))
    assert runner.spec.max_model_len == 6 * BLOCK - 1  # the context the server announces is what the pool can hold
    core = EngineCore(runner, llama_tokenizer, Scheduler(2, 16), frozenset())
    core.add(EngineRequest("huge", list(range(10, 40)), greedy(2)))
    outputs = core.step()
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] and not core.has_work()
    assert core.kv.usage().blocks_used == 0
    assert run(core, [EngineRequest("fits", PROMPTS[0], greedy(4))])["fits"] == llama_reference(llama, PROMPTS[0], 4)


# ------------------------------------------------------------------------------------------------------ T5


def test_t5_rows_preempted_for_room_resume_with_the_same_greedy_tokens(llama_tokenizer) -> None:
    model = AutoModelForSeq2SeqLM.from_pretrained(build_tiny_t5(cache_root() / "tiny-t5"), dtype=torch.float32).eval()
    runner = Seq2SeqRunner(model, max_rows=4, max_model_len=64, max_input_len=32, kv=space(model, 10, 4, 32))
    observer = Steps()
    core = EngineCore(runner, llama_tokenizer, Scheduler(4, 16), frozenset(), observer)
    inputs = PROMPTS[:4]
    requests = [EngineRequest(f"t{i}", [], greedy(), {"input_ids": ids}) for i, ids in enumerate(inputs)]
    tokens = run(core, requests)
    for req, ids in zip(requests, inputs, strict=True):
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens[req.request_id] == out[0, 1:].tolist()  # after the decoder start token
    assert observer.preemptions > 0
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0


# ------------------------------------------------------------------------------------------------- Whisper


def tiny_whisper():
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50,
        eos_token_id=51,
        pad_token_id=51,
        bos_token_id=51,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config = GenerationConfig.from_model_config(config)
    return model


@torch.inference_mode()
def whisper_reference(model, features: torch.Tensor, prefix: list[int]) -> list[int]:
    tokens = list(prefix)
    for _ in range(NEW_TOKENS):
        logits = model(input_features=features[None], decoder_input_ids=torch.tensor([tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prefix) :]


def test_whisper_rows_preempted_for_room_resume_with_the_same_greedy_tokens(llama_tokenizer) -> None:
    model = tiny_whisper()
    runner = WhisperRunner(model, max_rows=3, kv=space(model, 9, 3, 1500))
    observer = Steps()
    core = EngineCore(runner, llama_tokenizer, Scheduler(3, 16), frozenset(), observer)
    windows = [
        (torch.randn(80, WINDOW_FRAMES, generator=torch.Generator().manual_seed(i)), prefix)
        for i, prefix in enumerate([[50, 60], [49, 7, 8, 9, 50], [50]])
    ]
    requests = [
        EngineRequest(f"w{i}", prefix, greedy(), {"input_features": features})
        for i, (features, prefix) in enumerate(windows)
    ]
    tokens = run(core, requests)
    for req, (features, prefix) in zip(requests, windows, strict=True):
        assert tokens[req.request_id] == whisper_reference(model, features, prefix)
    assert observer.preemptions > 0
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0


def test_a_scored_prompt_preempted_mid_prefill_is_scored_whole_once(llama, llama_tokenizer) -> None:
    """A chunked prompt whose logprobs are asked for holds its blocks while prefilling; the row decoding beside it
    needs a block, the prompt (the newest request) is taken back, and starts over when there is room."""
    runner = CausalLMRunner(llama, max_rows=2, max_model_len=64, kv=space(llama, 10))
    observer = Steps()
    core = EngineCore(runner, llama_tokenizer, Scheduler(2, 16, max_prefill_tokens=2), frozenset(), observer)
    running = EngineRequest("running", list(range(10, 14)), greedy(12))
    core.add(running)
    core.step()  # prefilled (one block of 4 and one for what follows), decoding
    prompt = list(range(40, 67))  # 27 tokens (and one more): 7 blocks, all the pool leaves; 2 prefilled a step
    scored = EngineRequest("scored", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    core.add(scored)
    outputs: dict[str, list[RequestOutput]] = {"running": [], "scored": []}
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            outputs[output.request_id].append(output)
    assert observer.preemptions >= 1
    got = outputs["scored"][0].prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    with torch.inference_mode():
        expected = llama(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for position, entry in enumerate(got[1:], start=1):
        assert entry is not None
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-4)
    assert sum(o.completion_tokens for o in outputs["scored"][-1:]) == 2
    assert core.kv.usage().blocks_used == 0


def test_the_least_urgent_row_is_preempted_first(llama, llama_tokenizer) -> None:
    # Two requests of 9 + 14 tokens (6 blocks each) in a pool of 9 blocks: one must give way. The one that came
    # first has the larger priority value (less urgent): it is the one preempted, so the urgent one finishes first.
    runner = CausalLMRunner(llama, max_rows=2, max_model_len=64, kv=space(llama, 9))
    core = EngineCore(runner, llama_tokenizer, Scheduler(2, 4), frozenset(), Steps())
    low = EngineRequest("low", PROMPTS[0], greedy(), priority=5)
    urgent = EngineRequest("urgent", PROMPTS[0][::-1], greedy())
    tokens: dict[str, list[int]] = {"low": [], "urgent": []}
    finished: list[str] = []
    core.add(low)
    outputs = core.step()  # the less urgent one runs first
    core.add(urgent)
    while outputs or core.has_work():
        for output in outputs:
            tokens[output.request_id].extend(output.token_ids)
            if output.finished:
                finished.append(output.request_id)
        outputs = core.step() if core.has_work() else []
    assert finished == ["urgent", "low"]
    assert tokens == {r.request_id: llama_reference(llama, r.prompt_token_ids) for r in (low, urgent)}
