"""EngineCore + CausalLMRunner on the tiny Llama: greedy outputs under continuous batching equal `generate()` alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason, RequestOutput
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.stats import StepStats
from transformers_openai.runners.causal_lm import CausalLMRunner

torch.set_num_threads(1)

NEW_TOKENS = 12
TEXT = (
    "Continuous batching lets a server step many requests together, admitting new ones as old ones finish. "
    "Every row keeps its own cache, its own position ids and its own attention mask, so the answer for one "
    "request must not depend on who else shares the batch. This paragraph only provides enough tokens."
)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture
def core(model, tokenizer) -> EngineCore:
    runner = CausalLMRunner(model, max_rows=4, max_model_len=512)
    return EngineCore(runner, tokenizer, Scheduler(max_running=4, max_waiting=16), frozenset({tokenizer.eos_token_id}))


@pytest.fixture(scope="module")
def requests(tokenizer) -> list[EngineRequest]:
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    lengths = [1, 60, 7, 33, 13, 46, 20, 53, 26, 40]
    assert len(ids) >= max(lengths)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    return [EngineRequest(f"r{n}", ids[:n], params) for n in lengths]


@pytest.fixture(scope="module")
def reference(model, requests) -> dict[str, list[int]]:
    out = {}
    for req in requests:
        prompt = torch.tensor([req.prompt_token_ids])
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        out[req.request_id] = generated[0, prompt.shape[1] :].tolist()
    return out


def drive(core: EngineCore, requests: list[EngineRequest], every: int, on_step=None) -> dict[str, list[int]]:
    """Adds one request every `every` steps and steps until all are done; returns each request's tokens."""
    tokens: dict[str, list[int]] = {req.request_id: [] for req in requests}
    pending, step = list(requests), 0
    while pending or core.has_work():
        if pending and step % every == 0:
            core.add(pending.pop(0))
        for output in core.step():
            tokens[output.request_id].extend(output.token_ids)
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
        if on_step:
            on_step(step, tokens)
        step += 1
    return tokens


@pytest.mark.parametrize("every", [1, 3])
def test_staggered_batch_matches_generate(core, requests, reference, every: int) -> None:
    tokens = drive(core, requests, every)
    assert tokens == reference
    assert core.slots.in_use == 0
    assert not core.has_work()


def test_abort_frees_row_and_others_still_match(core, requests, reference) -> None:
    victim = requests[1].request_id
    aborted = []

    def abort_midway(step: int, tokens: dict[str, list[int]]) -> None:
        if step == 5:
            assert victim in core.scheduler.running and 0 < len(tokens[victim]) < NEW_TOKENS
            rows = core.slots.in_use
            output = core.abort(victim)
            assert output is not None and output.finish_reason == FinishReason.ABORT
            assert core.slots.in_use == rows - 1
            assert core.abort(victim) is None
            aborted.append(victim)

    tokens = drive(core, requests, every=1, on_step=abort_midway)
    assert aborted == [victim]
    assert tokens[victim] == reference[victim][: len(tokens[victim])]
    assert {k: v for k, v in tokens.items() if k != victim} == {k: v for k, v in reference.items() if k != victim}
    assert core.slots.in_use == 0


def test_abort_of_waiting_request_uses_no_row(core, requests) -> None:
    for req in requests[:6]:
        core.add(req)
    core.step()
    assert core.slots.in_use == 4
    waiting = next(iter(core.scheduler.waiting))
    output = core.abort(waiting)
    assert output is not None and output.finish_reason == FinishReason.ABORT and output.completion_tokens == 0
    assert core.slots.in_use == 4
    for req in requests[:6]:
        core.abort(req.request_id)
    assert core.slots.in_use == 0 and not core.has_work()


@pytest.fixture
def chunked_core(model, tokenizer) -> EngineCore:
    """Prompts prefilled 7 tokens per step: most of them over several steps, between decode steps."""
    runner = CausalLMRunner(model, max_rows=4, max_model_len=512)
    scheduler = Scheduler(max_running=4, max_waiting=16, max_prefill_tokens=7)
    return EngineCore(runner, tokenizer, scheduler, frozenset({tokenizer.eos_token_id}))


def test_chunked_prefill_matches_generate(chunked_core, requests, reference) -> None:
    tokens = drive(chunked_core, requests, every=2)
    assert tokens == reference
    assert chunked_core.slots.in_use == 0 and not chunked_core.has_work()


def test_running_rows_keep_decoding_while_a_long_prompt_is_prefilled(chunked_core, requests) -> None:
    short, long = requests[0], requests[1]  # 1 and 60 prompt tokens
    chunked_core.add(short)
    assert [o.request_id for o in chunked_core.step()] == [short.request_id] * 2  # first token, then a decode
    chunked_core.add(long)
    for _ in range(4):  # 60 tokens at 7 per step: still prefilling, and the short request gets a token each step
        outputs = chunked_core.step()
        assert [o.request_id for o in outputs] == [short.request_id]
        assert long.request_id in chunked_core.scheduler.prefilling
    assert chunked_core.slots.in_use == 2  # the long prompt holds its row from its first chunk on
    partial = chunked_core.scheduler.prefilling[long.request_id].prefill
    assert partial.kv is not None and partial.done == 28  # its blocks, reserved for the whole prompt, 4 chunks in
    held = chunked_core.kv.usage().blocks_used
    assert held == 1 + -(-61 // 16)  # the short row's block and the long prompt's (and its first token's)
    assert chunked_core.abort(long.request_id) is not None  # a partial prefill is dropped with its request
    assert partial.kv is None  # the K/V manager took its blocks back
    assert chunked_core.kv.usage().blocks_used == 1
    assert not chunked_core.scheduler.prefilling and chunked_core.slots.in_use == 1


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_equal_the_models_log_softmax(model, tokenizer, requests, chunked: bool) -> None:
    """Scored prompts (echo + logprobs, lm-eval's loglikelihood) among ordinary requests, whole or in 7-token chunks."""
    runner = CausalLMRunner(model, max_rows=4, max_model_len=512)
    scheduler = Scheduler(max_running=4, max_waiting=16, max_prefill_tokens=7 if chunked else 4096)
    core = EngineCore(runner, tokenizer, scheduler, frozenset({tokenizer.eos_token_id}))
    scored = [
        EngineRequest(
            "one-token",
            requests[1].prompt_token_ids,
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=2),
        ),
        EngineRequest("no-tokens", requests[7].prompt_token_ids, SamplingParams(max_tokens=0, prompt_logprobs=0)),
    ]
    outputs: dict[str, list[RequestOutput]] = {}
    for req in [requests[3], *scored, requests[5]]:
        core.add(req)
    while core.has_work():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert core.slots.in_use == 0
    for req in scored:
        first, last = outputs[req.request_id][0], outputs[req.request_id][-1]
        ids = req.prompt_token_ids
        with torch.inference_mode():
            expected = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        got = first.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        for position, entry in enumerate(got[1:], start=1):
            assert entry is not None and entry.token_id == ids[position]
            assert entry.logprob == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4)
            top = expected[position - 1].topk(req.params.prompt_logprobs or 1)
            if req.params.prompt_logprobs:
                assert [t for t, _ in entry.top] == top.indices.tolist()
            else:
                assert entry.top == []
        assert last.finish_reason == FinishReason.LENGTH
        assert last.completion_tokens == req.params.max_tokens
    assert outputs["no-tokens"][0].token_ids == [] and len(outputs["no-tokens"]) == 1
    assert all(o.prompt_logprobs is None for o in outputs[requests[3].request_id])


def test_each_step_reports_where_its_time_went(model, tokenizer, requests) -> None:
    from transformers_openai.engine.stats import STEP_PHASES, NullObserver
    from transformers_openai.metrics import Metrics

    class Recorder(NullObserver):
        def __init__(self) -> None:
            self.steps: list[StepStats] = []

        def on_step(self, stats) -> None:
            self.steps.append(stats)

    recorder = Recorder()
    runner = CausalLMRunner(model, max_rows=4, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(4, 16), frozenset({tokenizer.eos_token_id}), recorder)
    drive(core, requests[:4], every=2)
    worked = [s for s in recorder.steps if s.batch_size or s.prompt_tokens]
    assert worked and all(set(s.phase_s) <= {*STEP_PHASES, "total"} for s in worked)
    for stats in worked:
        parts = sum(v for k, v in stats.phase_s.items() if k != "total")
        assert all(v >= 0 for v in stats.phase_s.values()) and parts <= stats.phase_s["total"] + 1e-6
        if stats.batch_size:
            assert stats.phase_s["forward"] > 0 and "sample" in stats.phase_s and "output" in stats.phase_s
    metrics = Metrics("m")
    for stats in recorder.steps:
        metrics.on_step(stats)
    text = metrics.render().decode()
    decode_steps = sum(1 for s in worked if s.batch_size)
    count = 'transformers_openai:engine_step_phase_seconds_count{{model_name="m",phase="{}"}} {}.0'
    assert count.format("forward", decode_steps) in text and count.format("total", len(worked)) in text


class ForwardCounter:
    """Counts the model's forward calls and the rows each one ran over."""

    def __init__(self, model) -> None:
        self.batches: list[tuple[int, int]] = []  # (rows, columns) of each forward
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        self.batches.append(tuple(ids.shape))

    def close(self) -> None:
        self._handle.remove()


def test_a_burst_is_prefilled_in_a_few_padded_forwards_and_matches_generate(model, tokenizer, requests, reference):
    runner = CausalLMRunner(model, max_rows=10, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(10, 16), frozenset({tokenizer.eos_token_id}))
    counter = ForwardCounter(model)
    try:
        for req in requests:  # all ten at once: lengths 1 to 60, admitted in the first step
            core.add(req)
        first = core.step()
        *prefills, decode = counter.batches  # the step's prefill forwards, then its decode step of all rows
    finally:
        counter.close()
    assert sorted(o.request_id for o in first if o.completion_tokens == 1) == sorted(r.request_id for r in requests)
    # Fewer forwards than prompts, each padded to at most 1.25x its real tokens (the CPU setting).
    lengths = sorted(len(r.prompt_token_ids) for r in requests)
    assert decode == (len(requests), 1)
    assert 1 < len(prefills) < len(requests)
    assert sum(rows for rows, _ in prefills) == len(requests)
    assert sum(rows * cols for rows, cols in prefills) <= 1.25 * sum(lengths)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for output in first:
        tokens[output.request_id].extend(output.token_ids)
    while core.has_work():
        for output in core.step():
            tokens[output.request_id].extend(output.token_ids)
    assert tokens == reference
    assert core.slots.in_use == 0


def test_identical_prompts_share_one_prefill_and_each_row_decodes_alone(model, tokenizer, requests, reference):
    runner = CausalLMRunner(model, max_rows=4, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(4, 16), frozenset({tokenizer.eos_token_id}))
    base = requests[3]  # 33 tokens
    copies = [EngineRequest(f"copy{i}", list(base.prompt_token_ids), base.params) for i in range(3)]
    counter = ForwardCounter(model)
    tokens: dict[str, list[int]] = {req.request_id: [] for req in copies}
    try:
        for req in copies:
            core.add(req)
        while core.has_work():
            for output in core.step():
                tokens[output.request_id].extend(output.token_ids)
            if counter.batches and len(counter.batches) == 2:
                assert core.slots.in_use == 3
    finally:
        counter.close()
    # One forward of one prompt for the three rows; every later forward is a decode step of all three.
    assert counter.batches[0] == (1, 33)
    assert all(shape == (3, 1) for shape in counter.batches[1:])
    assert all(t == reference[base.request_id] for t in tokens.values())
    assert core.slots.in_use == 0


def test_batched_prefill_gives_each_prompt_its_own_logits_and_cache(model, requests) -> None:
    """Numerically, not only greedily (the tiny model's argmax hardly depends on positions)."""
    from tests.runner_driver import RunnerDriver

    runner = RunnerDriver(CausalLMRunner(model, max_rows=10, max_model_len=512))
    prompts = [list(r.prompt_token_ids) for r in requests]
    results = runner.prefill_batch([(runner.job(ids), 4096) for ids in prompts])
    slots = {}
    with torch.inference_mode():
        for ids, result in zip(prompts, results, strict=True):
            assert isinstance(result, tuple)
            slot, logits = result
            slots[slot] = ids
            alone = model(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)
        order, stepped = runner.decode(dict.fromkeys(slots, 5))
        for slot, logits in zip(order, stepped, strict=True):
            full = model(torch.tensor([[*slots[slot], 5]])).logits[0, -1]
            torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


def test_prompts_alike_only_after_different_cached_prefixes_are_not_taken_as_identical(model, tokenizer, requests):
    """Two prompts whose first block each comes from the prefix cache, different blocks, then the same new tokens:
    each is computed over its own prefix (a step that took them as one identical prompt would copy one's K/V into
    the other)."""
    runner = CausalLMRunner(model, max_rows=4, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(4, 16), frozenset({tokenizer.eos_token_id}))
    ids = list(requests[1].prompt_token_ids)  # 60 tokens
    first, second, tail = ids[:16], ids[16:32], ids[32:45]  # one block each, and a tail shorter than a block
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    drive(core, [EngineRequest("warm-a", [*first, 5], params), EngineRequest("warm-b", [*second, 5], params)], 1)
    prompts = {"a": [*first, *tail], "b": [*second, *tail]}
    before = core.kv.usage().prefix_hits
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    for name, prompt in prompts.items():  # both admitted in one step
        core.add(EngineRequest(name, prompt, params))
    while core.has_work():
        for output in core.step():
            tokens[output.request_id].extend(output.token_ids)
    assert core.kv.usage().prefix_hits - before == 2 * 16  # each found its own first block cached
    for name, prompt in prompts.items():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        assert tokens[name] == out[0, len(prompt) :].tolist(), name
