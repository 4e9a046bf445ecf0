"""`probe` runs a decode step for some rows and keeps nothing: the next real step is the same as without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from tests.model_factory import build_tiny_t5, cache_root
from tests.runner_driver import RunnerDriver
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.seq2seq import Seq2SeqRunner

torch.set_num_threads(1)

PROMPTS = [[5, 9, 14, 3], [7, 2], [11, 4, 6, 8, 10, 12, 13], [20, 21, 22]]


def causal_runner(tiny_llama_dir: Path) -> CausalLMRunner:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return CausalLMRunner(model, max_rows=4, max_model_len=64)


def seq2seq_runner() -> Seq2SeqRunner:
    model = AutoModelForSeq2SeqLM.from_pretrained(build_tiny_t5(cache_root() / "tiny-t5"), dtype=torch.float32)
    return Seq2SeqRunner(model.eval(), max_rows=4, max_model_len=64, max_input_len=64)


@pytest.fixture(params=["causal-lm", "seq2seq"])
def runners(request: pytest.FixtureRequest, tiny_llama_dir: Path):
    """Two runners of the same kind and model, filled with the same rows."""
    make = (lambda: causal_runner(tiny_llama_dir)) if request.param == "causal-lm" else seq2seq_runner

    def job(runner: RunnerDriver, prompt: list[int]) -> PrefillJob:  # a T5 reads the prompt with its encoder
        return runner.job(prompt) if request.param == "causal-lm" else runner.job([], {"input_ids": prompt})

    pair = []
    for _ in range(2):
        runner = RunnerDriver(make())
        slots = []
        for prompt in PROMPTS:
            result = runner.prefill(job(runner, prompt), 64)
            assert result is not None
            slots.append(result[0])
        pair.append((runner, slots))
    return pair


def test_probing_rows_changes_nothing_for_the_next_steps(runners) -> None:
    (probed, slots), (plain, plain_slots) = runners
    assert slots == plain_slots
    tokens = dict(zip(slots, [31, 32, 33, 34], strict=True))
    for step in range(3):
        probed.probe({slots[1]: 99, slots[3]: 98})  # other tokens than the real step feeds
        probed.probe({slots[2]: 97})
        order_a, logits_a = probed.decode(tokens)
        order_b, logits_b = plain.decode(tokens)
        assert order_a == order_b
        torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=0, msg=f"step {step}")
        tokens = dict(zip(order_a, logits_a.argmax(-1).tolist(), strict=True))


def test_a_probe_over_one_row_gives_that_row_s_logits(runners) -> None:
    (runner, slots), (reference, _) = runners
    tokens = dict(zip(slots, [31, 32, 33, 34], strict=True))
    order, batch_logits = reference.decode(tokens)
    seen = {}

    def capture(logits: torch.Tensor) -> torch.Tensor:
        seen["logits"] = logits[:, -1] if logits.dim() == 3 else logits  # [rows, kept positions, vocab]: the last
        return logits

    step = runner.runner._step

    def spying_step(*args, **kwargs):
        return capture(step(*args, **kwargs))

    runner.runner._step = spying_step
    runner.probe({slots[2]: 33})
    torch.testing.assert_close(seen["logits"][0], batch_logits[order.index(slots[2])], rtol=1e-5, atol=1e-5)
