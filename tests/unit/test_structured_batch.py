"""Constrained and free rows share one batch: every constrained answer validates, every free one is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.schemas import SCHEMAS
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.serving.structured_output import StructuredOutputs

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
        return EngineCore(CausalLMRunner(model, 8, 1024), tokenizer, Scheduler(8, 32), eos)

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
        jsonschema.validate(json.loads(text), schema)
    for request in free:
        assert results[request.request_id] == solo[request.request_id]
