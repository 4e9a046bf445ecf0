"""int8-dynamic answers do not depend on the batch: requests prefilled in one shared forward and decoded side by
side get, at every step, the very logits (bit for bit) they get alone, so their greedy tokens are those of each
request alone too. Activations rounded to int8 per token turn any last-bit difference of the float operations
before them into a different token where two nearly tie (SmolLM2: 10 of 10 chats parted within 30 tokens); every
query therefore attends alone through the in-place kernel (`CausalLMRunner.attend_per_query`), whatever the widths
and queries of the step it is in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.runner_driver import RunnerDriver
from transformers_openai.int8_linear import quantize_linear_layers, quantizes_activations
from transformers_openai.runners.base import Acceleration
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kernels.int8_gemv_kernel import use_rows_kernel
from transformers_openai.runners.packed_linear import pack_linear_layers
from transformers_openai.runners.steps.paged_step import PagedStep
from transformers_openai.runners.steps.step_store import has_cxx_compiler

pytestmark = pytest.mark.skipif(not has_cxx_compiler(), reason="the in-place kernel is built with a C++ compiler")

NEW_TOKENS = 16
TEXT = (
    "Rounding every activation to eight bits makes a model small and quick, but a row that shares its batch with "
    "others must still get the very same bits as alone, or a near tie between two tokens tips the other way. "
    "This paragraph only provides enough tokens for prompts of several lengths, the longest about seventy of them."
)
LENGTHS = [1, 60, 7, 33, 13, 46, 20, 53]  # eight rows: prefill groups padded, decode widths apart


@pytest.fixture(scope="module", params=["eager", "compiled"])
def driver(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunnerDriver:
    """The tiny Llama as the server runs it with --quantization int8-dynamic on a CPU: decode steps eager, or
    compiled where the int8 kernel serves its layers (the compiled graph calls the kernel's C++ operator, one for
    one row and one for more: a row alone and in a batch go through different graphs)."""
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert quantize_linear_layers(model) == 2 * 7 and quantizes_activations(model)
    kernels = tmp_path_factory.mktemp("kernels")
    pack_linear_layers(model)  # the output layer (oneDNN at every row count: logits compared bit for bit)
    # Rows 1-4 through the int8 kernel where the CPU has VNNI, more through _int_mm.
    with_kernel = use_rows_kernel(model, kernels) > 0
    compiled = request.param == "compiled"
    if compiled and not with_kernel:
        pytest.skip("int8 decode steps are compiled only where the int8 kernel serves the layers (VNNI)")
    runner = CausalLMRunner(model, max_rows=len(LENGTHS), max_model_len=512)
    runner.prepare(Acceleration(compiled=compiled, kernels=True, store=kernels))
    assert isinstance(runner.executor, PagedStep) and runner.executor.cache.per_query
    assert compiled == (runner.fixed is not None and runner.fixed.compiled)
    return RunnerDriver(runner)


def greedy_logits(driver: RunnerDriver, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    """The prompts prefilled in one step and decoded together greedily: each one's next-token logits at every step."""
    prefilled = driver.prefill_batch([(driver.job(prompt), len(prompt)) for prompt in prompts])
    logits: dict[int, list[torch.Tensor]] = {}
    for outcome in prefilled:
        assert outcome is not None and not isinstance(outcome, Exception)
        logits[outcome[0]] = [outcome[1]]
    for _ in range(NEW_TOKENS - 1):
        slots, step = driver.decode({slot: int(seen[-1].argmax()) for slot, seen in logits.items()})
        for slot, row in zip(slots, step, strict=True):
            logits[slot].append(row.clone())
    for slot in logits:
        driver.release(slot)
    return list(logits.values())


def test_requests_together_get_the_logits_of_each_alone(driver: RunnerDriver, tiny_llama_dir: Path) -> None:
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(TEXT, add_special_tokens=False).input_ids
    assert len(ids) >= max(LENGTHS)
    prompts = [ids[:n] for n in LENGTHS]
    together = greedy_logits(driver, prompts)
    alone = [greedy_logits(driver, [prompt])[0] for prompt in prompts]
    for length, batched, single in zip(LENGTHS, together, alone, strict=True):
        assert len(batched) == len(single) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(batched, single, strict=True)):
            assert torch.equal(a, b), (length, step, float((a - b).abs().max()))
    assert driver.rows_in_use() == 0
