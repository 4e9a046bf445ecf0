"""What balancers and routers read of a replica: readiness, /get_load, the load gauges under vLLM's names
(`--metrics-compat vllm`), ORCA load reports and X-Replica-Id; readiness turns 503 once a drain begins."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import ServerProcess, start_server, wait_for

LONG = {"model": "test-model", "prompt": "go", "max_tokens": 400, "ignore_eos": True}
LOAD = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_llama_dir, server_logs, "--metrics-compat", "vllm", "--replica-id", "replica-a", "--max-batch-size", "1"
    )
    yield server
    server.stop()


def gauges(server: ServerProcess) -> dict[str, float]:
    """Every gauge sample of /metrics by name, as prometheus_client's own parser reads the text."""
    text = httpx.get(f"{server.root_url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge":
            for sample in family.samples:
                found[sample.name] = sample.value
    return found


def load(server: ServerProcess) -> int:
    body = httpx.get(f"{server.root_url}/get_load", timeout=10).json()
    assert set(body) == {"load"}
    return int(body["load"])


def test_the_gauges_follow_the_load_under_both_names(replica: ServerProcess) -> None:
    before = gauges(replica)
    for name in LOAD:
        assert f"vllm:{name}" in before and f"transformers_openai:{name}" in before, name
    results: list[int] = []

    def send() -> None:
        results.append(httpx.post(f"{replica.base_url}/completions", json=LONG, timeout=120).status_code)

    senders = [threading.Thread(target=send) for _ in range(4)]
    for sender in senders:
        sender.start()
    seen: dict[str, float] = {}

    def saturated() -> bool:
        seen.update(gauges(replica))
        return seen["vllm:num_requests_waiting"] > 0 and seen["vllm:num_requests_running"] == 1

    assert wait_for(saturated, 60), seen
    assert seen["transformers_openai:num_requests_waiting"] == seen["vllm:num_requests_waiting"]
    assert 0 < seen["vllm:kv_cache_usage_perc"] <= 1
    assert load(replica) >= 2  # one running, others waiting
    for sender in senders:
        sender.join(timeout=120)
    assert results == [200] * 4
    assert wait_for(lambda: gauges(replica)["vllm:num_requests_waiting"] == 0, 10)
    after = gauges(replica)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert load(replica) == 0


def test_ready_replica_id_and_orca_load_reports(replica: ServerProcess) -> None:
    ready = httpx.get(f"{replica.root_url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert ready.headers["x-replica-id"] == "replica-a"
    missing = httpx.get(f"{replica.base_url}/models/nope", timeout=10)
    assert missing.status_code == 404 and missing.headers["x-replica-id"] == "replica-a"
    plain = httpx.get(f"{replica.base_url}/models", timeout=10)
    assert "endpoint-load-metrics" not in plain.headers
    as_json = httpx.get(f"{replica.base_url}/models", headers={"endpoint-load-metrics-format": "json"}, timeout=10)
    form, _, body = as_json.headers["endpoint-load-metrics"].partition(" ")
    assert form == "JSON" and set(json.loads(body)["named_metrics"]) == set(LOAD)
    as_text = httpx.get(f"{replica.base_url}/models", headers={"endpoint-load-metrics-format": "text"}, timeout=10)
    form, _, body = as_text.headers["endpoint-load-metrics"].partition(" ")
    pairs = dict(pair.strip().split("=") for pair in body.split(","))
    assert form == "TEXT" and set(pairs) == {f"named_metrics.{name}" for name in LOAD}
    assert all(float(value) >= 0 for value in pairs.values())


def test_readiness_turns_503_when_the_drain_begins(tiny_llama_dir: Path, server_logs: Path) -> None:
    server = start_server(tiny_llama_dir, server_logs, "--max-batch-size", "1")
    try:
        statuses: list[int] = []
        sender = threading.Thread(
            target=lambda: statuses.append(
                httpx.post(f"{server.base_url}/completions", json={**LONG, "max_tokens": 900}, timeout=120).status_code
            )
        )
        sender.start()
        assert wait_for(lambda: load(server) == 1, 30)
        server.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(f"{server.root_url}/ready", timeout=5).status_code == 503, 10)
        refused = httpx.post(f"{server.base_url}/completions", json=LONG, timeout=10)
        assert refused.status_code == 503
        sender.join(timeout=120)
        assert statuses == [200], "the request in flight finished"
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()
