"""Constrained and free rows share one batch: every constrained answer validates, every free one is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.schemas import COSTLY, SCHEMAS
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.errors import ConstraintFailed
from transformers_openai.engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.tokenizer import engine_decoder

torch.set_num_threads(1)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, tuple[list[int], FinishReason | None]]:
    results: dict[str, tuple[list[int], FinishReason | None]] = {r.request_id: ([], None) for r in requests}
    for request in requests:
        core.add(request)
    while core.has_work():
        for output in core.step():
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.token_ids, output.finish_reason)
    return results


def test_constrained_rows_validate_and_free_rows_match_their_solo_run(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    structured = StructuredOutputs(tokenizer)
    eos = frozenset({tokenizer.eos_token_id})

    def core() -> EngineCore:
        return EngineCore(CausalLMRunner(model, 8, 1024), engine_decoder(tokenizer), Scheduler(8, 32), eos)

    prompt = tokenizer("Answer in JSON, please.").input_ids
    free_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = [EngineRequest(f"free{i}", prompt[: 3 + i], free_params) for i in range(3)]
    solo = {r.request_id: run(core(), [r])[r.request_id] for r in free}
    constrained = []
    for i, schema in enumerate(SCHEMAS):
        (constraint,) = structured.constraints(schema, 1, "response_format")
        params = SamplingParams(max_tokens=1500, temperature=0.7 if i % 2 else 0.0, seed=i)
        constrained.append(EngineRequest(f"json{i}", prompt, params, constraint=constraint))
    results = run(core(), [*constrained[:5], *free, *constrained[5:]])
    for i, schema in enumerate(SCHEMAS):
        tokens, reason = results[f"json{i}"]
        assert reason is FinishReason.STOP
        text = tokenizer.decode([t for t in tokens if t not in eos])
        jsonschema.validate(json.loads(str(text)), schema)
    for request in free:
        assert results[request.request_id] == solo[request.request_id]


class GivesUp:
    """A constraint that allows every token and gives up at its `after`-th token (a grammar failing mid-answer)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.seen = 0

    def mask(self, logits: torch.Tensor) -> None:
        pass

    def advance(self, token_id: int) -> None:
        self.seen += 1
        if self.seen >= self.after:
            raise ConstraintFailed(f"the grammar gave up at token {token_id}")

    def is_done(self) -> bool:
        return False


def test_a_grammar_failing_mid_answer_ends_its_request_alone(tiny_llama_dir: Path) -> None:
    """One grammar fails while advancing, one while masking (its masks cost too much): each request ends with a
    constraint error (the client's fault: a 400 to serving), every other row goes on as it would alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    structured = StructuredOutputs(tokenizer)
    eos = frozenset({tokenizer.eos_token_id})

    def core() -> EngineCore:
        return EngineCore(CausalLMRunner(model, 8, 1024), engine_decoder(tokenizer), Scheduler(8, 32), eos)

    prompt = tokenizer("Answer in JSON, please.").input_ids
    free_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = [EngineRequest(f"free{i}", prompt[: 3 + i], free_params) for i in range(2)]
    solo = {r.request_id: run(core(), [r])[r.request_id] for r in free}
    (costly,) = structured.constraints(COSTLY, 1, "response_format")
    (valid,) = structured.constraints(SCHEMAS[0], 1, "response_format")
    params = SamplingParams(max_tokens=300, temperature=0.0)
    bound = [
        EngineRequest("gives-up", prompt, params, constraint=GivesUp(after=5)),
        EngineRequest("costly", prompt, params, constraint=costly),
        EngineRequest("valid", prompt, params, constraint=valid),
    ]
    engine = core()
    for request in [*bound, *free]:
        engine.add(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in [*bound, *free]}
    last: dict[str, RequestOutput] = {}
    while engine.has_work():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            last[output.request_id] = output
    for request_id, needle in (("gives-up", "gave up"), ("costly", "too costly")):
        output = last[request_id]
        assert output.finish_reason is FinishReason.ERROR and output.error_kind is ErrorKind.CONSTRAINT
        assert output.error is not None and needle in output.error
    assert len(tokens["gives-up"]) == 4  # the token it refused is not sent
    assert last["valid"].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(str(tokenizer.decode([t for t in tokens["valid"] if t not in eos]))), SCHEMAS[0])
    for request in free:
        assert (tokens[request.request_id], last[request.request_id].finish_reason) == solo[request.request_id]
