"""Overload gets a fast 429 with Retry-After; the running requests are unharmed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server
from tests.e2e.streaming import read_chunks


@pytest.fixture(scope="module")
def small_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "--max-batch-size", "2", "--max-queue", "1")
    yield server
    server.stop()


def test_queue_limit_gives_429(small_server: ServerProcess) -> None:
    url = f"{small_server.base_url}/completions"
    body = {"model": "test-model", "prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [client.stream("POST", url, json=body) for _ in range(3)]
            responses = [await s.__aenter__() for s in streams]  # 2 running + 1 queued
            try:
                assert [r.status_code for r in responses] == [200, 200, 200]
                started = time.monotonic()
                rejected = await client.post(url, json={**body, "stream": False})
                assert time.monotonic() - started < 2.0
                assert rejected.status_code == 429
                assert int(rejected.headers["retry-after"]) >= 1
                error = rejected.json()["error"]
                assert error["type"] and error["message"] and error["code"] == "server_overloaded"
                state = small_server.engine_state()
                assert state["running"] <= 2 and state["in_flight"] == 3
                assert len(await read_chunks(responses[0], limit=2)) == 2  # running requests still stream
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
        deadline = time.monotonic() + 20
        while small_server.engine_state()["in_flight"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        ok = httpx.post(url, json={"model": "test-model", "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200

    asyncio.run(run())


def test_more_choices_than_the_server_can_hold_is_a_400_not_a_429(small_server: ServerProcess) -> None:
    response = httpx.post(
        f"{small_server.base_url}/completions",
        json={"model": "test-model", "prompt": ["a", "b"], "n": 2, "max_tokens": 2},  # 4 > 2 rows + 1 queued
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
