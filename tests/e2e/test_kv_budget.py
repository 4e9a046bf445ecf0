"""A server whose K/V budget holds far less than its batch: a burst completes (requests preempted and recomputed,
greedy outputs unchanged), the pool never exceeds the budget, and a request that can never fit gets a 400."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e import reference
from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess, start_server

# The tiny Llama's K/V take 512 bytes a token: 200 KiB are 25 blocks of 16 tokens (one kept zero), 384 tokens.
BUDGET = "200KiB"
BLOCKS = 24
PROMPTS = [
    f"Item {i}: a line about {topic} and nothing else"
    for i, topic in enumerate(["rivers", "bread", "old maps", "winter", "trains", "stars", "the moon", "cats"])
]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def budget_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "--max-batch-size", "8", "--kv-cache-memory", BUDGET)
    yield server
    server.stop()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^transformers_openai:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_the_context_announced_is_what_the_pool_can_hold(budget_server: ServerProcess) -> None:
    assert f"{BLOCKS * 16 - 1} tokens" in budget_server.log()  # the warning that lowered the context
    response = httpx.post(
        f"{budget_server.base_url}/completions",
        json={"model": budget_server.model, "prompt": "hello", "max_tokens": BLOCKS * 16},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and str(BLOCKS * 16 - 1) in error["message"]


def test_a_burst_beyond_the_budget_completes_with_the_same_greedy_outputs(
    budget_server: ServerProcess, tiny_llama_dir: Path
) -> None:
    # 8 rows of about 12 + 60 tokens need 40 blocks: more than the 24 there are.
    async def burst() -> list[tuple[str, int]]:
        client = async_client(budget_server)

        async def one(prompt: str) -> tuple[str, int]:
            response = await client.completions.create(
                model=budget_server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert response.usage is not None
            return response.choices[0].text, response.usage.completion_tokens

        try:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        finally:
            await client.close()

    results = asyncio.run(burst())
    for prompt, (text, tokens) in zip(PROMPTS, results, strict=True):
        ids = reference.text_prompt_ids(tiny_llama_dir, prompt)
        expected = reference.greedy(tiny_llama_dir, ids, MAX_TOKENS)
        assert (text, tokens) == (expected.text, MAX_TOKENS), prompt  # the tiny model never stops early here
    metrics = httpx.get(f"{budget_server.root_url}/metrics", timeout=10).text
    assert metric(metrics, "num_preemptions_total") > 0
    assert metric(metrics, "kv_cache_blocks_used") == 0
    assert metric(metrics, "kv_cache_blocks_free") == BLOCKS
    assert 0 < metric(metrics, "kv_cache_blocks_cached") <= BLOCKS  # the answers' full blocks, kept for reuse
    state = budget_server.engine_state()
    assert state["kv_blocks_used"] == 0 and state["rows_in_use"] == 0
