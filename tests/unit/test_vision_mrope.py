"""A vision-language model with multimodal rotary positions (Qwen2-VL's M-RoPE) through the engine: concurrent
requests with 0, 1 or 2 images, preempted for room or prefilled in small chunks, each give the greedy tokens of the
model's own `generate` alone, and every prompt position's logprob equals the model's own forward."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.vision_models import qwen2_vl_inputs, tiny_qwen2_vl
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.stats import NullObserver, StepStats
from transformers_openai.model_loader import vision_model_problem
from transformers_openai.runners.kv.kv_pool import KVSpace, self_attention_geometry
from transformers_openai.runners.vision_lm import VisionLMRunner

torch.set_num_threads(1)

BLOCK = 4
NEW_TOKENS = 8
TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
# (image sizes (width, height), text): 84 px and larger images stand on fewer positions than they have tokens, so the
# text after them is offset.
REQUESTS: list[tuple[list[tuple[int, int]], str]] = [
    ([(84, 84)], "What is in this picture?"),
    ([], "Say hello."),
    ([(112, 84), (60, 100)], "Compare these two images, please."),
    ([(100, 100)], "Describe."),
    ([], "A longer text-only request that goes on for a while to make it long."),
    ([(90, 70), (84, 112)], "Which one?"),
]


class Steps(NullObserver):
    def __init__(self) -> None:
        self.preemptions = 0

    def on_step(self, stats: StepStats) -> None:
        self.preemptions += stats.preemptions


class Qwen:
    def __init__(self) -> None:
        path = tiny_qwen2_vl()
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        self.images = Qwen2VLImageProcessorPil.from_pretrained(path)

    def inputs(self, index: int) -> dict[str, Any]:
        sizes, text = REQUESTS[index]
        images = [_image(10 * index + j, size) for j, size in enumerate(sizes)]
        return qwen2_vl_inputs(self.tokenizer, self.images, images, text)

    def request(self, index: int, params: SamplingParams) -> EngineRequest:
        inputs = self.inputs(index)
        encoder_inputs: dict[str, Any] = {}
        if "pixel_values" in inputs:
            encoder_inputs = {key: value for key, value in inputs.items() if key not in TOKEN_KEYS}
            digest = hashlib.sha256(inputs["pixel_values"].numpy().tobytes()).hexdigest()
            encoder_inputs.update(image_digest=digest, images=len(inputs["image_grid_thw"]))
        return EngineRequest(f"r{index}", inputs["input_ids"][0].tolist(), params, encoder_inputs=encoder_inputs)

    def generate(self, index: int) -> tuple[list[int], list[float]]:
        """The model's own greedy tokens and their logprobs (the logits of every step: decode positions checked)."""
        inputs = self.inputs(index)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = [float(step[0].log_softmax(-1)[token]) for step, token in zip(out.logits, new, strict=True)]
        return new, logprobs

    def space(self, blocks: int) -> KVSpace:
        per_token = self_attention_geometry(self.model).bytes_per_token
        return KVSpace(bytes=(blocks + 1) * BLOCK * per_token, block_size=BLOCK)


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen() -> Qwen:
    return Qwen()


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)


Generated = dict[str, tuple[list[int], list[float]]]  # request -> its tokens and their logprobs


def run(core: EngineCore, requests: list[EngineRequest]) -> Generated:
    tokens: Generated = {r.request_id: ([], []) for r in requests}
    for request in requests:
        core.add(request)
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            tokens[output.request_id][0].extend(output.token_ids)
            tokens[output.request_id][1].extend(entry.logprob for entry in output.logprobs or ())
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
    return tokens


def test_the_text_after_an_image_is_offset(qwen: Qwen) -> None:
    inputs = qwen.inputs(2)
    _, delta = qwen.model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    assert int(delta.reshape(-1)[0]) < -4  # what the tests below would miss with ordinary positions
    assert vision_model_problem(qwen.model, None) is None
    runner = VisionLMRunner(qwen.model, max_rows=1, max_model_len=64, kv=qwen.space(20))
    request = qwen.request(2, greedy())
    assert runner.prefill_cost(request.encoder_inputs) == len(inputs["pixel_values"])  # a row per patch


@pytest.mark.parametrize("chunk", [None, 5], ids=["preempted", "chunked"])
def test_concurrent_requests_equal_generate_alone(qwen: Qwen, chunk: int | None) -> None:
    requests = [qwen.request(i, greedy()) for i in range(len(REQUESTS))]
    expected = {f"r{i}": qwen.generate(i) for i in range(len(REQUESTS))}
    needs = [-(-(len(r.prompt_token_ids) + NEW_TOKENS + 1) // BLOCK) for r in requests]
    budget = sum(needs) if chunk else max(needs) + 3
    runner = VisionLMRunner(qwen.model, max_rows=6, max_model_len=512, kv=qwen.space(budget))
    assert not runner.fix_steps(graphs=False, buckets=True)  # decode positions are per row: eager steps
    observer = Steps()
    scheduler = Scheduler(6, 16, max_prefill_tokens=chunk or 4096)
    core = EngineCore(runner, qwen.tokenizer, scheduler, frozenset(), observer, lookahead=chunk is None)
    got = run(core, requests)
    for request_id, (tokens, logprobs) in expected.items():
        assert got[request_id][0] == tokens
        torch.testing.assert_close(torch.tensor(got[request_id][1]), torch.tensor(logprobs), atol=2e-4, rtol=0)
    if chunk is None:
        assert observer.preemptions > 0
    assert core.kv.usage().blocks_used == 0 and not runner._features
    assert runner._mrope is not None and not runner._mrope._prompts and not runner._mrope._deltas  # nothing kept


def test_prompt_logprobs_in_chunks_equal_the_models_own_forward(qwen: Qwen) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    indices = [0, 1, 2]
    requests = [qwen.request(i, params) for i in indices]
    runner = VisionLMRunner(qwen.model, max_rows=3, max_model_len=512, kv=qwen.space(200))
    core = EngineCore(runner, qwen.tokenizer, Scheduler(3, 16, max_prefill_tokens=6), frozenset())
    scores: dict[str, list[float]] = {}
    for request in requests:
        core.add(request)
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            if output.prompt_logprobs is not None:
                scores[output.request_id] = [entry.logprob for entry in output.prompt_logprobs[1:] if entry]
    for index, request in zip(indices, requests, strict=True):
        with torch.inference_mode():
            logits = qwen.model(**qwen.inputs(index)).logits[0, :-1]
        ids = torch.tensor(request.prompt_token_ids[1:])[:, None]
        expected = logits.log_softmax(-1).gather(1, ids)[:, 0]
        torch.testing.assert_close(torch.tensor(scores[request.request_id]), expected, atol=2e-4, rtol=0)
