"""Greedy outputs under continuous batching equal model.generate on each request alone; seeds survive batching."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from openai.types import Completion

from tests.e2e import reference
from tests.e2e.conftest import Served, async_client
from tests.e2e.server import ServerProcess

PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea and the wind at night.",
    "List three fruits.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "1, 2, 3, 4,",
    "Tell me a story about a dragon who learned to bake bread in a small village by the mountains, "
    "and how the villagers reacted when they first tasted it.",
    "Translate 'good morning' to French.",
    "Name a color.",
    "Why do cats purr? Give a short answer with one surprising fact that most people do not know.",
]

# The first token is computed for each request alone; later steps run in a padded batch, where only
# float summation order may differ. A padding bug (e.g. cross-attention over padding) moves logits by O(1).
FIRST_STEP_ATOL = 1e-4
LATER_STEP_ATOL = 1e-3


async def _concurrent_completions(
    server: ServerProcess, max_tokens: int, stagger_s: float
) -> list[tuple[str, int, list[float]]]:
    client = async_client(server)

    async def one(i: int, prompt: str) -> tuple[str, int, list[float]]:
        await asyncio.sleep(i * stagger_s)  # arrivals spread over the running batch
        response = await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0
        )
        choice = response.choices[0]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert response.usage is not None
        return choice.text, response.usage.completion_tokens, list(choice.logprobs.token_logprobs)

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
    finally:
        await client.close()


def _assert_equal_to_generate(model_dir: Path, results: list[tuple[str, int, list[float]]], max_tokens: int) -> None:
    for prompt, (text, tokens, logprobs) in zip(PROMPTS, results, strict=True):
        expected = reference.greedy(model_dir, reference.text_prompt_ids(model_dir, prompt), max_tokens)
        assert text == expected.text, f"prompt {prompt!r}"
        assert tokens == expected.completion_tokens, f"prompt {prompt!r}"
        assert len(logprobs) == len(expected.logprobs)
        assert logprobs[0] == pytest.approx(expected.logprobs[0], abs=FIRST_STEP_ATOL)
        assert logprobs == pytest.approx(expected.logprobs, abs=LATER_STEP_ATOL), f"prompt {prompt!r}"


def test_concurrent_greedy_equals_generate(served: Served) -> None:
    results = asyncio.run(_concurrent_completions(served.server, max_tokens=24, stagger_s=0.02))
    _assert_equal_to_generate(served.model_dir, results, 24)
    assert served.server.engine_state()["rows_in_use"] == 0


@pytest.mark.slow
def test_concurrent_greedy_equals_generate_smollm2(smollm2_server: ServerProcess, smollm2_dir: Path) -> None:
    results = asyncio.run(_concurrent_completions(smollm2_server, max_tokens=20, stagger_s=0.3))
    _assert_equal_to_generate(smollm2_dir, results, 20)


def test_seeded_sample_is_the_same_alone_and_in_a_busy_batch(served: Served) -> None:
    server = served.server

    async def run() -> tuple[str, str]:
        client = async_client(server)

        async def seeded() -> Completion:
            return await client.completions.create(
                model=server.model, prompt="Once upon a time", max_tokens=24, temperature=1.0, top_p=0.9, seed=1234
            )

        try:
            alone = (await seeded()).choices[0].text
            noise = [
                client.completions.create(model=server.model, prompt=p, max_tokens=30, temperature=1.0)
                for p in PROMPTS[:6]
            ]
            results = await asyncio.gather(*noise[:3], seeded(), *noise[3:])
            return alone, results[3].choices[0].text
        finally:
            await client.close()

    alone, busy = asyncio.run(run())
    assert alone == busy
    assert len(alone) > 0
