"""One failing row never hurts the others: a fault injected in prefill, decode, sampling or detokenizing ends
that request alone, and the healthy requests around it finish with the same tokens and text as alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.base import Acceleration, Prepared, Step, StepOutput
from transformers_openai.runners.causal_lm import CausalLMRunner

torch.set_num_threads(1)

NEW_TOKENS = 10
TEXT = "One bad request must never hurt another: every row fails alone, and the others go on as if it never was."
MARKER = 17  # a token id only the poisoned request's prompt starts with


class Injected(RuntimeError):
    """The fault a test plants."""


class FaultyRunner:
    """A real CausalLMRunner that fails in prefill or in decode whenever the poisoned request's row takes part."""

    def __init__(self, inner: CausalLMRunner, fail_in: str) -> None:
        self.inner = inner
        self.fail_in = fail_in
        self.spec = inner.spec
        self.poisoned_slot: int | None = None
        self.probes = 0
        self.decodes = 0  # decode steps asked for (probes apart)
        self.fail_decode_at: int | None = None  # that decode step fails as a whole, whatever its rows

    def prepare(self, acceleration: Acceleration) -> Prepared:
        return self.inner.prepare(acceleration)

    def prefill_cost(self, encoder_inputs: Mapping[str, Any]) -> int:
        return self.inner.prefill_cost(encoder_inputs)

    def execute(self, step: Step) -> StepOutput:
        for row in step.prefills:
            if row.tokens[:1] == [MARKER]:
                self.poisoned_slot = row.slot
        if step.probe:
            self.probes += 1
        elif step.decodes:
            self.decodes += 1
            if self.decodes == self.fail_decode_at:
                raise Injected("the whole step")
        if self.fail_in == "decode" and any(row.slot == self.poisoned_slot for row in step.decodes):
            raise Injected("decode")
        if self.fail_in != "prefill" or all(row.slot != self.poisoned_slot for row in step.prefills):
            return self.inner.execute(step)
        healthy = [row for row in step.prefills if row.slot != self.poisoned_slot]
        out = self.inner.execute(Step(healthy, step.decodes, step.probe))
        done = iter(out.prefills)
        prefills = [Injected("prefill") if row.slot == self.poisoned_slot else next(done) for row in step.prefills]
        return StepOutput(prefills, out.slots, out.logits)

    def release(self, slot: int) -> None:
        if slot == self.poisoned_slot:
            self.poisoned_slot = None
        self.inner.release(slot)


@dataclass
class FaultyDecoder:
    """A tokenizer whose decode fails on any window holding the marker (the poisoned prompt's context)."""

    inner: Any

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if MARKER in token_ids:
            raise Injected("detokenize")
        return str(self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert MARKER not in ids
    return ids


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
SEEDED = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, seed=1234)


def healthy_requests(prompt_ids: list[int]) -> list[EngineRequest]:
    return [
        EngineRequest("a", prompt_ids[:5], GREEDY),
        EngineRequest("b", prompt_ids[:19], SEEDED),
        EngineRequest("c", prompt_ids[:11], GREEDY),
    ]


def make_core(model, decoder, fail_in: str = "none") -> tuple[EngineCore, FaultyRunner]:
    runner = FaultyRunner(CausalLMRunner(model, max_rows=4, max_model_len=256), fail_in)
    core = EngineCore(runner, decoder, Scheduler(max_running=4, max_waiting=8), frozenset({0}))
    return core, runner


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, dict[str, Any]]:
    """Adds every request, steps until done; per request: tokens, text, finish reason, error."""
    results: dict[str, dict[str, Any]] = {r.request_id: {"tokens": [], "text": ""} for r in requests}
    for request in requests:
        core.add(request)
        if request.request_id == "bad" and request.params.temperature == 1.0:  # the sampling fault
            core.scheduler.waiting["bad"].sampler_row.generator = BrokenGenerator()  # type: ignore[assignment]
    for _ in range(200):
        if not core.has_work():
            break
        for output in core.step():
            result = results[output.request_id]
            result["tokens"] += output.token_ids
            result["text"] += output.text
            if output.finished:
                result["finish_reason"], result["error"] = output.finish_reason, output.error
    assert not core.has_work()
    return results


@pytest.fixture(scope="module")
def alone(model, tokenizer, prompt_ids) -> dict[str, dict[str, Any]]:
    """Each healthy request run by itself on a fault-free engine."""
    results = {}
    for request in healthy_requests(prompt_ids):
        core, _ = make_core(model, tokenizer)
        results.update(run(core, [request]))
    return results


class BrokenGenerator:
    """Lets the engine save and rewind its state, then fails when the sampler draws from it."""

    def get_state(self) -> torch.Tensor:
        return torch.Generator().get_state()

    def set_state(self, state: torch.Tensor) -> None:
        return None


def poisoned(fail_in: str, prompt_ids: list[int]) -> EngineRequest:
    if fail_in == "sampling":  # its generator is swapped for a broken one once it is added (see `run`)
        return EngineRequest("bad", prompt_ids[:7], SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0))
    return EngineRequest("bad", [MARKER, *prompt_ids[:3]], GREEDY)  # short: the marker stays in the detokenizer context


@pytest.mark.parametrize("fail_in", ["prefill", "decode", "sampling", "detokenize"])
def test_a_failing_row_ends_alone_and_the_others_match_their_solo_run(
    fail_in: str, model, tokenizer, prompt_ids, alone
) -> None:
    decoder = FaultyDecoder(tokenizer) if fail_in == "detokenize" else tokenizer
    core, runner = make_core(model, decoder, fail_in)
    requests = healthy_requests(prompt_ids)
    requests.insert(1, poisoned(fail_in, prompt_ids))  # among the healthy ones, not at an edge

    results = run(core, requests)

    bad = results.pop("bad")
    assert bad["finish_reason"] is FinishReason.ERROR
    assert bad["error"]
    for request_id, result in results.items():
        assert result["finish_reason"] is FinishReason.LENGTH, (request_id, result.get("error"))
        assert result["tokens"] == alone[request_id]["tokens"], request_id
        assert result["text"] == alone[request_id]["text"], request_id
    assert core.slots.in_use == 0
    if fail_in == "decode":
        assert runner.probes >= 1  # found by probing, not by luck


def test_a_step_failure_no_single_row_causes_ends_the_step_rows_and_the_engine_goes_on(
    model, tokenizer, prompt_ids, alone
) -> None:
    core, runner = make_core(model, tokenizer)
    runner.fail_decode_at = 2
    first = run(core, healthy_requests(prompt_ids))
    assert all(r["finish_reason"] is FinishReason.ERROR for r in first.values())
    assert core.slots.in_use == 0
    again = run(core, healthy_requests(prompt_ids)[:1])  # the engine still serves afterwards
    assert again["a"]["tokens"] == alone["a"]["tokens"]
