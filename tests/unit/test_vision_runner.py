"""Vision-language models through the engine: 8 concurrent requests with 0, 1 or 2 images and prompts of several
lengths, in a K/V pool small enough that some are preempted and recomputed with their images, each give the greedy
tokens of the model's own `generate` on that request alone; so does a prefill cut into small chunks (inside an
image's tokens); a repeated image and text reuses its cached prefix, the same text with another image does not."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from tests.vision_models import FAMILIES, tiny_vlm
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.kv_manager import KVManager
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.engine.request import EngineRequest, FinishReason
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.stats import NullObserver, StepStats
from transformers_openai.model_loader import VISION_KIND, detect_kind, served_kind, vision_model_problem
from transformers_openai.runners.base import KVPoolSpec
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_pool import KVSpace, self_attention_geometry
from transformers_openai.runners.vision_lm import VisionLMRunner

torch.set_num_threads(1)

BLOCK = 4
NEW_TOKENS = 6
TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
# (images, their sizes (width, height), text) of the 8 concurrent requests.
REQUESTS: list[tuple[int, list[tuple[int, int]], str]] = [
    (1, [(40, 30)], "What is in this picture?"),
    (0, [], "Say hello."),
    (2, [(30, 30), (64, 48)], "Compare these two images, please, in detail."),
    (1, [(50, 70)], "Describe."),
    (0, [], "A much longer text-only request that goes on for a while to make the prompt long."),
    (2, [(36, 36), (30, 60)], "Which one?"),
    (1, [(60, 30)], "Colours?"),
    (1, [(45, 45)], "Count the shapes in the image and name them one by one."),
]


class Steps(NullObserver):
    def __init__(self) -> None:
        self.stats: list[StepStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.stats.append(stats)

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.stats)


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


class Family:
    """A tiny checkpoint loaded once: its model, processor, and the requests built with its processor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.processor: Any = AutoProcessor.from_pretrained(path)

    def inputs(self, images: list[Image.Image], text: str) -> Any:
        """The processor's output for one user message of `images` then `text`."""
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        rendered = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        return self.processor(text=rendered, images=images or None, return_tensors="pt")

    def request(self, request_id: str, images: list[Image.Image], text: str) -> tuple[EngineRequest, list[int]]:
        """The engine request of that message, and the model's own greedy tokens for it alone."""
        inputs = self.inputs(images, text)
        prompt = inputs["input_ids"][0].tolist()
        encoder_inputs: dict[str, Any] = {}
        if images:
            encoder_inputs = {key: value for key, value in inputs.items() if key not in TOKEN_KEYS}
            digest = hashlib.sha256(b"".join(image.tobytes() for image in images)).hexdigest()
            encoder_inputs.update(image_digest=digest, images=len(images))
        params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        return EngineRequest(request_id, prompt, params, encoder_inputs=encoder_inputs), out[0, len(prompt) :].tolist()

    def space(self, blocks: int) -> KVSpace:
        per_token = self_attention_geometry(self.model).bytes_per_token
        return KVSpace(bytes=(blocks + 1) * BLOCK * per_token, block_size=BLOCK)


@pytest.fixture(scope="module")
def families() -> Iterator[dict[str, Family]]:
    loaded: dict[str, Family] = {}
    yield loaded
    loaded.clear()


def family(families: dict[str, Family], name: str) -> Family:
    if name not in families:
        families[name] = Family(tiny_vlm(name))
    return families[name]


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add(request)
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.token_ids)
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
    return tokens


def concurrent(fam: Family) -> tuple[list[EngineRequest], dict[str, list[int]]]:
    requests, expected = [], {}
    for i, (_, sizes, text) in enumerate(REQUESTS):
        request, reference = fam.request(f"r{i}", [_image(10 * i + j, size) for j, size in enumerate(sizes)], text)
        requests.append(request)
        expected[request.request_id] = reference
    return requests, expected


def blocks_for(requests: list[EngineRequest]) -> list[int]:
    return [-(-(len(r.prompt_token_ids) + NEW_TOKENS + 1) // BLOCK) for r in requests]


CASES = [*((name, False) for name in FAMILIES), ("llava", True)]


@pytest.mark.parametrize(("name", "fixed"), CASES, ids=[f"{n}{'-fixed' if f else ''}" for n, f in CASES])
def test_concurrent_image_requests_preempted_and_reused_equal_generate_alone(
    families: dict[str, Family], name: str, fixed: bool
) -> None:
    fam = family(families, name)
    requests, expected = concurrent(fam)
    needs = blocks_for(requests)
    budget = max(needs) + 4  # the largest request fits, far from all of them together: preemption
    assert budget < sum(needs) // 2
    runner = VisionLMRunner(fam.model, max_rows=8, max_model_len=512, kv=fam.space(budget))
    if fixed:  # decode steps, and short text prefills, from fixed buffers (as CUDA graphs run them)
        assert runner.fix_steps(graphs=False, buckets=True)
    observer = Steps()
    # With fixed steps also the decode launched ahead of its records, as on a GPU.
    core = EngineCore(runner, fam.processor.tokenizer, Scheduler(8, 16), frozenset(), observer, lookahead=fixed)
    assert run(core, requests) == expected
    assert observer.preemptions > 0

    # The first request's image and text, twice: the second finds the first's blocks (the pool is too small to keep
    # them from the batch above); the same text with another image finds none of them and gets its own tokens.
    _, sizes, text = REQUESTS[0]
    again, again_expected = fam.request("again", [_image(0, sizes[0])], text)
    assert again.prompt_token_ids == requests[0].prompt_token_ids and again_expected == expected["r0"]
    assert run(core, [again]) == {"again": again_expected}
    hits = core.kv.usage().prefix_hits
    again = EngineRequest("again2", again.prompt_token_ids, again.params, encoder_inputs=again.encoder_inputs)
    assert run(core, [again]) == {"again2": again_expected}
    reused = core.kv.usage().prefix_hits - hits
    assert reused >= BLOCK * (len(again.prompt_token_ids) // BLOCK - 1)
    other, other_expected = fam.request("other", [_image(99, sizes[0])], text)
    assert other.prompt_token_ids == again.prompt_token_ids  # the same tokens: only the image tells them apart
    hits = core.kv.usage().prefix_hits
    assert run(core, [other]) == {"other": other_expected}
    assert core.kv.usage().prefix_hits == hits
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0 and not runner._features


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_chunks_cut_inside_images_equal_generate_alone(families: dict[str, Family], name: str) -> None:
    fam = family(families, name)
    requests, expected = concurrent(fam)
    chosen = [requests[i] for i in (0, 1, 2, 5)]
    runner = VisionLMRunner(fam.model, max_rows=4, max_model_len=512, kv=fam.space(sum(blocks_for(chosen))))
    cuts: list[int] = []
    forward = runner._paged.forward_embeds

    def counted(
        rows: Sequence[tuple[BlockTable, torch.Tensor]], keep: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        cuts.extend(len(embeds) for _, embeds in rows)
        return forward(rows, keep, positions)

    runner._paged.forward_embeds = counted  # type: ignore[method-assign]
    core = EngineCore(runner, fam.processor.tokenizer, Scheduler(4, 16, max_prefill_tokens=7), frozenset())
    assert run(core, chosen) == {r.request_id: expected[r.request_id] for r in chosen}
    assert cuts and max(cuts) <= 7  # chunks of at most 7 tokens: images cut into several
    assert not runner._features and core.kv.usage().blocks_used == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_logprobs_in_chunks_equal_the_models_own_forward(families: dict[str, Family], name: str) -> None:
    """Every prompt position's logprob, chunk by chunk (7 tokens at most: images cut): a check on each position's
    merged embedding that greedy tokens of a random model are too coarse for."""
    fam = family(families, name)
    chosen = [0, 1, 2]
    runner = VisionLMRunner(fam.model, max_rows=3, max_model_len=512, kv=fam.space(200))
    core = EngineCore(runner, fam.processor.tokenizer, Scheduler(3, 16, max_prefill_tokens=7), frozenset())
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    requests, inputs = [], {}
    for i in chosen:
        _, sizes, text = REQUESTS[i]
        images = [_image(10 * i + j, size) for j, size in enumerate(sizes)]
        request, _ = fam.request(f"r{i}", images, text)
        requests.append(EngineRequest(request.request_id, request.prompt_token_ids, params, request.encoder_inputs))
        inputs[request.request_id] = fam.inputs(images, text)
    scores: dict[str, list[float]] = {}
    for request in requests:
        core.add(request)
    while core.has_work():
        for output in core.step():
            assert output.error is None, output.error
            if output.prompt_logprobs is not None:
                scores[output.request_id] = [entry.logprob for entry in output.prompt_logprobs[1:] if entry]
    for request in requests:
        with torch.inference_mode():
            logits = fam.model(**inputs[request.request_id]).logits[0, :-1]
        ids = torch.tensor(request.prompt_token_ids[1:])[:, None]
        expected = logits.log_softmax(-1).gather(1, ids)[:, 0]
        torch.testing.assert_close(torch.tensor(scores[request.request_id]), expected, atol=2e-4, rtol=0)


def test_image_features_are_encoded_together_across_a_steps_rows(families: dict[str, Family]) -> None:
    fam = family(families, "llava")
    requests, expected = concurrent(fam)
    with_images = [r for r in requests if r.encoder_inputs]
    runner = VisionLMRunner(fam.model, max_rows=8, max_model_len=512, kv=fam.space(sum(blocks_for(with_images))))
    passes: list[int] = []
    hook = fam.model.model.vision_tower.register_forward_pre_hook(lambda m, args: passes.append(len(args[0])))
    try:
        core = EngineCore(runner, fam.processor.tokenizer, Scheduler(8, 16), frozenset())
        assert run(core, with_images) == {r.request_id: expected[r.request_id] for r in with_images}
    finally:
        hook.remove()
    assert passes == [sum(r.encoder_inputs["images"] for r in with_images)]  # one vision pass for all
    assert runner.prefill_cost(with_images[0].encoder_inputs) == 25  # one 30 px image of 6 px patches
    assert runner.prefill_cost({}) == 0


def test_images_that_cannot_be_encoded_fail_their_request_alone(families: dict[str, Family]) -> None:
    fam = family(families, "llava")
    requests, expected = concurrent(fam)
    good = [requests[i] for i in (0, 1, 3)]
    broken = requests[6]
    pixels = broken.encoder_inputs["pixel_values"]
    bad = EngineRequest(
        "bad", broken.prompt_token_ids, broken.params, {**broken.encoder_inputs, "pixel_values": pixels[:, :2]}
    )
    runner = VisionLMRunner(fam.model, max_rows=4, max_model_len=512, kv=fam.space(200))
    core = EngineCore(runner, fam.processor.tokenizer, Scheduler(4, 16), frozenset())
    tokens: dict[str, list[int]] = {r.request_id: [] for r in good}
    errors: dict[str, str] = {}
    for request in [*good, bad]:
        core.add(request)
    while core.has_work():
        for output in core.step():
            if output.error is not None:
                errors[output.request_id] = output.error
            else:
                tokens[output.request_id].extend(output.token_ids)
    assert list(errors) == ["bad"] and "prefill failed" in errors["bad"]
    assert tokens == {r.request_id: expected[r.request_id] for r in good}
    assert not runner._features and core.kv.usage().blocks_used == 0 and core.slots.in_use == 0


def test_the_same_tokens_share_blocks_only_with_the_same_images() -> None:
    manager = KVManager(KVPoolSpec(num_blocks=40, block_size=BLOCK))
    prompt = list(range(100, 121))

    def admitted(digest: str | None) -> PrefillJob:
        job = PrefillJob(prompt, {"image_digest": digest, "images": 1} if digest else {})
        assert manager.reserve(job, len(prompt) + 1, 0)
        job.done = len(prompt)
        manager.prefilled(job)
        return job

    admitted("a" * 64)
    assert manager.usage().prefix_hits == 0
    admitted("b" * 64)  # another image: nothing shared
    assert manager.usage().prefix_hits == 0
    admitted(None)  # no image at all: nothing shared either
    assert manager.usage().prefix_hits == 0
    admitted("a" * 64)  # the first image again: its full blocks but the last token's
    assert manager.usage().prefix_hits == 20


def test_vision_checkpoints_are_detected_and_placement_limits_refused(families: dict[str, Family]) -> None:
    for name in FAMILIES:
        assert detect_kind(AutoConfig.from_pretrained(tiny_vlm(name))) == VISION_KIND
    fam = family(families, "llava")
    assert vision_model_problem(fam.model, None) is None
    problem = vision_model_problem(fam.model, "auto")
    assert problem is not None and "--device-map" in problem


def test_models_whose_images_the_runner_cannot_place_serve_text_only() -> None:
    """Gemma 3 masks its image tokens by token type; Qwen3-VL has multimodal positions of its own (and feeds image
    features to inner layers): both are served as decoders, for text, as before they were detected as vision models."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    text: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 128,
    }
    siglip = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    gemma = Gemma3Config(
        text_config=text, vision_config={**siglip, "image_size": 28, "patch_size": 14}, mm_tokens_per_image=1
    )
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
    qwen3 = Qwen3VLConfig(
        text_config={**text, "rope_parameters": mrope}, vision_config={**vision, "deepstack_visual_indexes": [0]}
    )
    for config, model_class, cause in [
        (gemma, Gemma3ForConditionalGeneration, "token_type_ids"),
        (qwen3, Qwen3VLForConditionalGeneration, "multimodal position ids"),
    ]:
        assert detect_kind(config) == VISION_KIND
        problem = vision_model_problem(model_class(config), None)
        assert problem is not None and cause in problem
        assert served_kind(config) == "causal-lm"
    assert served_kind(AutoConfig.from_pretrained(tiny_vlm("llava"))) == VISION_KIND
