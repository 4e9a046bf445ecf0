"""Client disconnects abort their requests: rows are freed at once, others finish correctly, memory stays flat."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import reference
from tests.e2e.conftest import Served
from tests.e2e.server import ServerProcess
from tests.e2e.streaming import completion_text, read_chunks

LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}


async def _wait_idle(server: ServerProcess, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            state = (await client.get(f"{server.root_url}/health")).json()["engine"]
            if not (state["rows_in_use"] or state["kv_blocks_used"] or state["running"] or state["waiting"]):
                return state
            if time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.1)


def test_disconnect_aborts_mid_generation_for_each_kind(served: Served) -> None:
    server = served.server
    url = f"{server.base_url}/completions"
    max_tokens = 400
    body = {
        "model": "test-model",
        "prompt": "Count forever:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url, json=body, headers={"X-Request-Id": "victim-1"}) as response:
                assert response.status_code == 200
                assert response.headers["x-request-id"] == "victim-1"
                await read_chunks(response, limit=2)
            state = await _wait_idle(server, timeout_s=30)
            assert state["rows_in_use"] == 0 and state["kv_blocks_used"] == 0 and state["in_flight"] == 0, state
            request_id = "victim-1"
            line = next(line for line in server.log().splitlines() if f"{request_id}-0 aborted" in line)
            produced = int(line.split(" after ")[1].split()[0])
            assert produced < max_tokens  # freed mid-generation, not after finishing

    asyncio.run(run())


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_row(smollm2_server: ServerProcess, smollm2_dir: Path) -> None:
    prompts = ["The history of Rome", "Tell me about the ocean.", "Why is the sky blue?"]

    async def run() -> tuple[list[str], float]:
        url = f"{smollm2_server.base_url}/completions"
        async with httpx.AsyncClient(timeout=120) as client:

            async def victim() -> None:
                body = {"model": "test-model", "prompt": "Count forever: 1, 2, 3,", **LONG}
                async with client.stream("POST", url, json=body) as response:
                    assert response.status_code == 200
                    assert len(await read_chunks(response, limit=3)) == 3
                # leaving the block closes the connection mid-stream

            async def bystander(prompt: str) -> str:
                body = {"model": "test-model", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
                async with client.stream("POST", url, json=body) as response:
                    return completion_text(await read_chunks(response))

            started = time.monotonic()
            _, texts = await asyncio.gather(
                asyncio.gather(victim(), victim()), asyncio.gather(*(bystander(p) for p in prompts))
            )
            state = await _wait_idle(smollm2_server, timeout_s=30)
            assert state["rows_in_use"] == 0 and state["running"] == 0, state
            return texts, time.monotonic() - started

    texts, elapsed = asyncio.run(run())
    # 1500 tokens per victim would take minutes here: the rows were freed by the disconnect, not by finishing.
    assert elapsed < 60
    assert smollm2_server.log().count("aborted") >= 2
    for prompt, text in zip(prompts, texts, strict=True):
        expected, _ = reference.greedy_text(smollm2_dir, reference.text_prompt_ids(smollm2_dir, prompt), 24)
        assert text == expected


def _bytes_per_cached_block(model_dir: Path, block_size: int = 16) -> int:
    """What one K/V block of the fp32 test server takes: every layer's keys and values for `block_size` tokens."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4 * block_size


@pytest.mark.slow
def test_200_requests_half_disconnecting_leave_no_state_and_no_growth(
    smollm2_server: ServerProcess, smollm2_dir: Path
) -> None:
    """Nothing outlives its request except what the prefix cache keeps on purpose: the full blocks of finished
    answers stay cached (bounded by --kv-cache-memory) and their pages count as growth; nothing else may grow."""
    url = f"{smollm2_server.base_url}/completions"
    topics = ["cats", "rivers", "old maps", "winter", "bread", "trains", "stars", "the moon"]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": "test-model",
            "prompt": f"A short note about {topics[i % len(topics)]} (#{i}):",
            "max_tokens": 24,
            "temperature": 0.7,
            "seed": i,
            "stream": True,
        }
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            if i % 2:
                await read_chunks(response, limit=2)  # disconnect mid-stream
            else:
                assert (await read_chunks(response))[-1]["choices"][0]["finish_reason"] in {"stop", "length"}

    async def wave(start: int, count: int) -> int:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            gate = asyncio.Semaphore(16)

            async def bounded(i: int) -> None:
                async with gate:
                    await one(client, i)

            await asyncio.gather(*(bounded(i) for i in range(start, start + count)))
        state = await _wait_idle(smollm2_server, timeout_s=30)
        cached = state.pop("kv_blocks_cached")
        assert state == {"running": 0, "waiting": 0, "paused": 0, "rows_in_use": 0, "kv_blocks_used": 0, "in_flight": 0}
        return cached

    cached_before = asyncio.run(wave(0, 20))
    baseline = smollm2_server.rss_bytes()
    cached_after = asyncio.run(wave(20, 180))
    after = smollm2_server.rss_bytes()
    assert cached_after > cached_before  # the finished answers' full blocks are kept for reuse
    cache_growth = (cached_after - cached_before) * _bytes_per_cached_block(smollm2_dir)
    assert after <= baseline * 1.10 + cache_growth, (
        f"RSS grew from {baseline / 2**20:.0f} MiB to {after / 2**20:.0f} MiB "
        f"({cache_growth / 2**20:.0f} MiB of it newly cached prefix blocks)"
    )
