"""Two replicas of the tiny model behind vLLM's own router (`vllm-router` from PyPI, a Rust binary): it checks them
with GET /health, reads GET /get_load, and re-serializes each body with its own fields added (`no_stop_trim`,
`separate_reasoning`, ...), which the replicas accept. 100 concurrent requests through it (chat and completions,
streaming and not) all succeed, in the right shape, spread over both replicas, each received exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import ServerProcess, free_port, replicas_of, wait_for

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
pytestmark = [
    pytest.mark.skipif(
        ROUTER is None, reason="vllm-router is not installed (scripts/env.sh installs it pinned with EXTRAS=test)"
    ),
]

NAMES = ("replica-a", "replica-b")
REQUESTS = 100
MAX_TOKENS = 8
KINDS = ("chat", "chat-stream", "completion", "completion-stream")
ENDPOINTS = ("chat_completions", "completions")


@dataclass
class Router:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, server_logs: Path) -> Iterator[dict[str, ServerProcess]]:
    with replicas_of(tiny_llama_dir, server_logs, NAMES, "--max-batch-size", "16", "--max-queue", "128") as started:
        yield started


@contextlib.contextmanager
def router(replicas: dict[str, ServerProcess], policy: str, log_dir: Path) -> Iterator[Router]:
    port = free_port()
    log_path = log_dir / f"vllm-router-{port}.log"
    assert ROUTER is not None
    command = [
        ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--worker-urls", *(replica.root_url for replica in replicas.values()),
        # Its Prometheus endpoint defaults to port 29000, which another test run may hold.
        "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    running = Router(process, port, log_path)

    def both_healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            readiness = httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=2)
            return readiness.status_code == 200 and readiness.json().get("healthy_workers") == len(replicas)
        return False

    try:
        if not wait_for(both_healthy, 60):
            raise RuntimeError(f"vllm-router did not see both replicas healthy:\n{log_path.read_text()}")
        yield running
    finally:
        running.stop()


def received(replica: ServerProcess) -> int:
    """Chat and completion requests the replica has received (its `requests_total` counter)."""
    text = httpx.get(f"{replica.root_url}/metrics", timeout=10).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "transformers_openai:requests_total" and sample.labels.get("endpoint") in ENDPOINTS
        )
    )


async def send(client: AsyncOpenAI, n: int) -> str:
    """Request `n` through the router, of kind KINDS[n % 4]; checks the answer's shape; the replica that answered."""
    kind = KINDS[n % len(KINDS)]
    # Prompts differ from their first word, so that a cache-aware router has no shared prefix to follow.
    text = f"{n} little pigs went to market"
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    extra = {"ignore_eos": True}  # every answer runs to max_tokens: its length is known
    usage: ChatCompletionStreamOptionsParam = {"include_usage": True}
    chat, completions = client.chat.completions.with_raw_response, client.completions.with_raw_response
    if kind == "chat":
        raw_chat = await chat.create(model="test-model", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra)
        answer = raw_chat.parse()
        [choice] = answer.choices
        assert answer.object == "chat.completion"
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason == "length"
        assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
        return str(raw_chat.headers["x-replica-id"])
    if kind == "completion":
        raw_text = await completions.create(model="test-model", prompt=text, max_tokens=MAX_TOKENS, extra_body=extra)
        completion = raw_text.parse()
        [text_choice] = completion.choices
        assert completion.object == "text_completion" and isinstance(text_choice.text, str)
        assert text_choice.finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
        return str(raw_text.headers["x-replica-id"])
    if kind == "chat-stream":
        raw_chunks = await chat.create(
            model="test-model",
            messages=messages,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options=usage,
            extra_body=extra,
        )
        chunks = [chunk async for chunk in raw_chunks.parse()]
        with_choices = [chunk for chunk in chunks if chunk.choices]
        assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == ["length"], kind
        assert with_choices[0].choices[0].delta.role == "assistant"
        assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
        return str(raw_chunks.headers["x-replica-id"])
    raw_pieces = await completions.create(
        model="test-model", prompt=text, max_tokens=MAX_TOKENS, stream=True, stream_options=usage, extra_body=extra
    )
    pieces = [piece async for piece in raw_pieces.parse()]
    finish = [p.choices[0].finish_reason for p in pieces if p.choices and p.choices[0].finish_reason]
    assert finish == ["length"], kind
    assert all(piece.object == "text_completion" for piece in pieces)
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == MAX_TOKENS
    return str(raw_pieces.headers["x-replica-id"])


async def send_all(base_url: str) -> list[str | BaseException]:
    # No retries in the client: a request the router loses is an error here.
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(send(client, n) for n in range(REQUESTS)), return_exceptions=True)


@pytest.mark.parametrize("policy", ["power_of_two", "cache_aware"])
def test_100_requests_through_vllm_router_none_lost(
    replicas: dict[str, ServerProcess], server_logs: Path, policy: str
) -> None:
    with router(replicas, policy, server_logs) as running:
        before = {name: received(replica) for name, replica in replicas.items()}
        results = asyncio.run(send_all(running.base_url))
        after = {name: received(replica) for name, replica in replicas.items()}
    failed = [result for result in results if isinstance(result, BaseException)]
    served = Counter(result for result in results if isinstance(result, str))
    counted = {name: after[name] - before[name] for name in NAMES}
    succeeded = len(results) - len(failed)
    print(f"\nvllm-router --policy {policy}: {succeeded} of {REQUESTS} succeeded; per replica {dict(served)}")
    assert not failed, [repr(error) for error in failed[:5]]
    assert set(served) == set(NAMES), f"one replica served everything: {served}"
    # Each replica received exactly the requests it answered: none lost, none sent twice.
    assert counted == dict(served), (counted, served)
