"""Running it as a service: /metrics after real traffic, API keys, CORS, X-Request-Id, SIGTERM draining."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess, start_server
from tests.e2e.streaming import SSEReader, read_chunks

KEY = "sk-test-key"
ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_llama_dir,
        server_logs,
        "--max-batch-size",
        "2",
        "--max-queue",
        "1",
        "--api-key",
        f"other-key,{KEY}",
        "--allowed-origins",
        ORIGIN,
        "--log-format",
        "json",
    )
    yield server
    server.stop()


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of one metric (all label sets matching `labels`) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        sample = line.split("{")[0].split(" ")[0]
        if sample == f"transformers_openai:{name}" and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_api_key_and_cors(guarded: ServerProcess) -> None:
    ok = openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0)
    usage = ok.completions.create(model="test-model", prompt="hi", max_tokens=2).usage
    assert usage is not None and usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="test-model", prompt="hi", max_tokens=2)
    assert httpx.get(f"{guarded.root_url}/health").status_code == 200  # open by default
    preflight = httpx.options(
        f"{guarded.base_url}/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.options(
        f"{guarded.base_url}/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in denied.headers


def test_metrics_move_with_traffic_disconnects_and_429(guarded: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(f"{guarded.root_url}/metrics").text
    url = f"{guarded.base_url}/completions"
    long_body = {"model": "test-model", "prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}

    async def traffic() -> None:
        async with httpx.AsyncClient(timeout=60, headers=auth) as client:
            done = await client.post(url, json={"model": "test-model", "prompt": "count", "max_tokens": 5})
            assert done.status_code == 200
            streams = [client.stream("POST", url, json=long_body) for _ in range(3)]
            responses = [await s.__aenter__() for s in streams]
            assert [r.status_code for r in responses] == [200, 200, 200]
            rejected = await client.post(url, json=long_body)
            assert rejected.status_code == 429
            await read_chunks(responses[0], limit=2)  # stops reading: closes the connection
            await read_chunks(responses[1], limit=1)  # the second running one after its first token
            for s in streams:  # all three disconnect mid-stream (one of them while queued)
                await s.__aexit__(None, None, None)
        deadline = time.monotonic() + 20
        while guarded.engine_state()["in_flight"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    asyncio.run(traffic())
    after = httpx.get(f"{guarded.root_url}/metrics").text
    assert after.startswith("# HELP") or "transformers_openai:" in after

    def moved(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert moved("request_success_total", finished_reason="length") >= 1
    assert moved("request_client_disconnected_total") >= 2
    assert moved("request_success_total", finished_reason="abort") >= 2
    assert moved("request_rejected_total") == 1
    assert moved("prompt_tokens_total") >= 2
    assert moved("generation_tokens_total") >= 5
    assert moved("time_to_first_token_seconds_count") >= 3
    assert moved("e2e_request_latency_seconds_count") >= 3
    assert moved("request_queue_time_seconds_count") >= 3
    assert moved("inter_token_latency_seconds_count") >= 4
    assert moved("batch_size_count") >= 1
    assert _metric(after, "kv_cache_rows_in_use") == 0
    assert _metric(after, "num_requests_running") == 0


def test_request_id_is_echoed_and_logged(guarded: ServerProcess) -> None:
    response = httpx.post(
        f"{guarded.base_url}/completions",
        json={"model": "test-model", "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-abc-123"},
    )
    assert response.headers["x-request-id"] == "trace-abc-123"
    assert response.json()["id"] == "cmpl-trace-abc-123"
    generated = httpx.get(f"{guarded.root_url}/health").headers["x-request-id"]
    assert len(generated) >= 16
    log = guarded.log()
    finished = [line for line in log.splitlines() if '"request_id": "trace-abc-123' in line]
    assert any('"finish_reason": "length"' in line for line in finished)  # structured JSON line
    assert any('"logger": "uvicorn.access"' in line for line in finished)  # access log carries it too


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_llama_dir: Path, server_logs: Path) -> None:
    server = start_server(tiny_llama_dir, server_logs, "--shutdown-timeout", "60")
    url = f"{server.base_url}/completions"
    body = {"model": "test-model", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url, json=body) as response:
            reader = SSEReader(response)
            chunks = await reader.read(limit=3)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await client.post(url, json={**body, "stream": False})
            assert refused.status_code == 503
            assert refused.json()["error"]["message"]
            chunks += await reader.read()
            return chunks

    try:
        chunks = asyncio.run(run())
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()
