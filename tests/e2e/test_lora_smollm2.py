"""LoRA adapters on the real SmolLM2-135M-Instruct (30 layers, its own packed float32 products): completions under
adapter A, adapter B and the base, streamed and not, share batches and each equals its own `PeftModel.generate`
greedy answer alone; the tiny Llama's tests (test_lora.py) cover preemption and adapters loaded at run time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import ServerProcess, start_server
from tests.e2e.test_lora import _complete, peft_greedy
from tests.model_factory import build_tiny_lora, cache_root

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = ["The river runs", "My favourite recipe is", "In the year 1900,"]


@pytest.fixture(scope="module")
def smollm2_loras(smollm2_dir: Path) -> Path:
    """Two rank-8 adapters on every projection, weights small enough that answers stay text (a few words change)."""
    root = cache_root() / "smollm2-loras"
    for name, seed in (("a", 1), ("b", 2)):
        build_tiny_lora(root / name, smollm2_dir, seed=seed, scale=0.02)
    return root


@pytest.fixture(scope="module")
def smollm2_lora_server(smollm2_dir: Path, smollm2_loras: Path, server_logs: Path) -> Iterator[ServerProcess]:
    modules = f"adapter-a={smollm2_loras / 'a'},adapter-b={smollm2_loras / 'b'}"
    server = start_server(smollm2_dir, server_logs, "--max-batch-size", "8", "--lora-modules", modules)
    yield server
    server.stop()


def test_smollm2_adapters_and_the_base_in_one_batch_answer_as_peft_alone(
    smollm2_lora_server: ServerProcess, smollm2_dir: Path, smollm2_loras: Path
) -> None:
    adapters = {"adapter-a": smollm2_loras / "a", "adapter-b": smollm2_loras / "b", "test-model": None}
    jobs = [(model, prompt, (i + j) % 2 == 0) for i, prompt in enumerate(PROMPTS) for j, model in enumerate(adapters)]
    texts = asyncio.run(_complete(smollm2_lora_server, jobs, MAX_TOKENS))
    expected = [peft_greedy(smollm2_dir, adapters[model], prompt, MAX_TOKENS) for model, prompt, _ in jobs]
    assert texts == expected
    # Per prompt the jobs are adapter A, adapter B, the base: each adapter changes some answer, so it was applied.
    assert any(texts[i] != texts[i + 2] for i in range(0, len(jobs), 3))
    assert any(texts[i + 1] != texts[i + 2] for i in range(0, len(jobs), 3))
