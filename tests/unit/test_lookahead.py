"""Decode steps launched ahead (`EngineCore(lookahead=True)`, the server's mode over CUDA graphs): each step launches
the next decode before it records its own tokens. Outputs are those of the engine without it (greedy tokens equal
`generate` alone, stop strings, end tokens, seeded sampling, aborts, preemption), and every block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason, RequestOutput
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.base import Step, StepOutput
from transformers_openai.runners.causal_lm import CausalLMRunner

torch.set_num_threads(1)

PROMPTS = [list(range(20 + 5 * i, 20 + 5 * i + n)) for i, n in enumerate([12, 3, 30, 7, 18, 1])]
MAX_TOKENS = [9, 14, 5, 12, 7, 10]  # rows finish at different steps


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def make_core(model, tokenizer, lookahead: bool, fixed: bool = True, stop_ids=frozenset(), rows: int = 4):
    runner = CausalLMRunner(model, max_rows=rows, max_model_len=128)
    if fixed:  # padded to buckets, as CUDA graphs run them
        assert runner.fix_steps(graphs=False, buckets=True)
    return EngineCore(runner, tokenizer, Scheduler(rows, 32), stop_ids, lookahead=lookahead)


def drive(core: EngineCore, requests: list[EngineRequest], every: int = 2, abort: tuple[str, int] | None = None):
    """Adds a request every `every` steps (aborting `abort[0]` after step `abort[1]`); each request's outputs."""
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    pending = list(requests)
    step = 0
    while pending or core.has_work():
        if pending and step % every == 0:
            core.add(pending.pop(0))
        for output in core.step():
            outputs[output.request_id].append(output)
        step += 1
        if abort is not None and step == abort[1]:
            aborted = core.abort(abort[0])
            assert aborted is not None
            outputs[abort[0]].append(aborted)
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **more)


@pytest.mark.parametrize("fixed", [False, True], ids=["grouped-decode", "fixed-decode"])
@pytest.mark.parametrize("every", [1, 3])
def test_greedy_tokens_under_staggered_batching_equal_generate(model, tokenizer, fixed, every) -> None:
    core = make_core(model, tokenizer, lookahead=True, fixed=fixed)
    requests = [EngineRequest(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]
    outputs = drive(core, requests, every)
    for request, n in zip(requests, MAX_TOKENS, strict=True):
        assert tokens(outputs[request.request_id]) == generate(model, request.prompt_token_ids, n)
        assert outputs[request.request_id][-1].finish_reason == FinishReason.LENGTH


class CountingDecodes:
    """Counts the decode steps a runner is asked for, and the rows in them."""

    def __init__(self, runner: CausalLMRunner) -> None:
        self.steps = self.rows = 0
        self._execute = runner.execute
        runner.execute = self  # type: ignore[method-assign]

    def __call__(self, step: Step) -> StepOutput:
        if step.decodes and not step.probe:
            self.steps += 1
            self.rows += len(step.decodes)
        return self._execute(step)


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_next_decode_is_launched_before_the_last_tokens_are_recorded(model, tokenizer, lookahead) -> None:
    # One request of 6 tokens: the first comes from its prefill, each other from a decode step. Launched ahead, the
    # decode after the last token is launched before that token is recorded as the last: its row is dropped.
    core = make_core(model, tokenizer, lookahead)
    counted = CountingDecodes(core.runner)
    outputs = drive(core, [EngineRequest("r", PROMPTS[0], greedy(6))])
    assert tokens(outputs["r"]) == generate(model, PROMPTS[0], 6)
    assert counted.steps == (6 if lookahead else 5)


def test_stop_strings_end_tokens_and_seeded_sampling_end_as_without_lookahead(model, tokenizer) -> None:
    # Stops taken from what the rows say without any: a stop string mid-answer, a frequent token as the end token.
    plain = drive(make_core(model, tokenizer, lookahead=False), [EngineRequest("a", PROMPTS[2], greedy(14))])
    said = tokens(plain["a"])
    text = "".join(output.text for output in plain["a"])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    end = said[5]

    def requests() -> list[EngineRequest]:
        return [
            EngineRequest("stop-string", PROMPTS[2], greedy(14, stop=[stop])),
            EngineRequest("end-token", PROMPTS[2], SamplingParams(max_tokens=14, temperature=0.0)),
            EngineRequest("seeded", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)),
            EngineRequest(
                "penalised",
                PROMPTS[3],
                SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, min_tokens=12),
            ),
            EngineRequest("long", PROMPTS[4], greedy(14)),
        ]

    def run(lookahead: bool) -> dict[str, list[tuple[str, list[int], FinishReason | None]]]:
        core = make_core(model, tokenizer, lookahead, stop_ids=frozenset({end}), rows=5)
        outputs = drive(core, requests(), every=1)
        return {rid: [(o.text, o.token_ids, o.finish_reason) for o in outs] for rid, outs in outputs.items()}

    ahead, before = run(True), run(False)
    assert ahead == before
    assert before["stop-string"][-1][2] == FinishReason.STOP and len(before["stop-string"]) < 14
    assert before["end-token"][-1][2] == FinishReason.STOP and before["end-token"][-1][1] == [end]


def test_a_row_aborted_while_its_decode_is_launched_frees_its_memory_and_the_others_match(model, tokenizer) -> None:
    core = make_core(model, tokenizer, lookahead=True)
    requests = [EngineRequest(f"r{i}", p, greedy(12)) for i, p in enumerate(PROMPTS[:4])]
    outputs = drive(core, requests, every=1, abort=("r1", 6))
    assert outputs["r1"][-1].finish_reason == FinishReason.ABORT
    assert len(tokens(outputs["r1"])) < 12
    for request in requests:
        if request.request_id != "r1":
            assert tokens(outputs[request.request_id]) == generate(model, request.prompt_token_ids, 12)
