"""The Batch API against real servers, driven by the openai client: a chat batch and an embeddings batch (100 lines
each) run side by side to completion; a server killed with SIGKILL half-way through a batch and started again over
the same --data-dir finishes it with each custom_id answered exactly once; cancel stops a batch."""

from __future__ import annotations

import io
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types import Batch

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess, start_server, wait_for

LINES = 100
FINAL = ("completed", "failed", "cancelled", "expired")


def start(model: Path, data_dir: Path, logs: Path) -> ServerProcess:
    return start_server(model, logs, "--data-dir", str(data_dir), "--batch-concurrency", "6", "--max-batch-size", "8")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-chat")


@dataclass
class Current:
    """The chat server of this module's tests: the first, then the one started again after it was killed."""

    server: ServerProcess


@pytest.fixture(scope="module")
def chat_server(tiny_llama_dir: Path, chat_data: Path, server_logs: Path) -> Iterator[Current]:
    current = Current(start(tiny_llama_dir, chat_data, server_logs))
    yield current
    current.server.stop()


def chat_lines(count: int, max_tokens: int, prefix: str = "chat") -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "test-model",
                "messages": [{"role": "user", "content": f"count to {i}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for i in range(count)
    ]


def submit(client: OpenAI, lines: list[dict[str, Any]], endpoint: Any) -> Batch:
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    assert file.bytes == len(data) and file.purpose == "batch"
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def wait_final(client: OpenAI, batch_id: str, timeout_s: float = 240) -> Batch:
    found: list[Batch] = []

    def final() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in FINAL

    assert wait_for(final, timeout_s), found[-1] if found else batch_id
    return found[0]


def output_lines(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_batches_side_by_side_and_a_server_killed_half_way(
    chat_server: Current, tiny_llama_dir: Path, chat_data: Path, tiny_bert_dir: Path, tmp_path: Path, server_logs: Path
) -> None:
    """A chat batch (with one bad line) and an embeddings batch run at once on two servers; the chat server is killed
    with SIGKILL half-way and started again over its --data-dir: both batches complete, each line answered once."""
    with start(tiny_bert_dir, tmp_path, server_logs) as embedding_server:
        chat, embed = sync_client(chat_server.server), sync_client(embedding_server)
        lines = chat_lines(LINES, 16)
        lines.insert(7, {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {}})
        chat_batch = submit(chat, lines, "/v1/chat/completions")
        embed_batch = submit(embed, embedding_lines(LINES), "/v1/embeddings")

        def half_way() -> bool:
            counts = chat.batches.retrieve(chat_batch.id).request_counts
            return counts is not None and counts.completed >= LINES // 3

        assert wait_for(half_way, 180)
        os.killpg(chat_server.server.process.pid, signal.SIGKILL)
        chat_server.server.process.wait(10)
        chat_server.server = start(tiny_llama_dir, chat_data, server_logs)
        chat = sync_client(chat_server.server)
        finished = wait_final(chat, chat_batch.id)
        assert finished.status == "completed" and finished.request_counts is not None, finished
        counts = finished.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES + 1, LINES, 1)
        answered = [line["custom_id"] for line in output_lines(chat, finished.output_file_id)]
        assert answered == [f"chat-{i}" for i in range(LINES)]  # each exactly once, in the input's order
        first = output_lines(chat, finished.output_file_id)[0]["response"]
        assert first["status_code"] == 200 and first["body"]["usage"]["completion_tokens"] == 16
        errors = output_lines(chat, finished.error_file_id)
        assert [(line["custom_id"], line["error"]["code"]) for line in errors] == [("bad", "mismatched_url")]

        embedded = wait_final(embed, embed_batch.id)
        assert embedded.status == "completed" and embedded.error_file_id is None, embedded
        vectors = output_lines(embed, embedded.output_file_id)
        assert [line["custom_id"] for line in vectors] == [f"emb-{i}" for i in range(LINES)]
        assert all(len(line["response"]["body"]["data"][0]["embedding"]) > 0 for line in vectors)


def embedding_lines(count: int) -> list[dict[str, Any]]:
    body = {"model": "test-model"}
    return [
        {"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings", "body": {**body, "input": f"text {i}"}}
        for i in range(count)
    ]


def test_cancel_stops_a_batch(chat_server: Current) -> None:
    server = chat_server.server
    client = sync_client(server)
    batch = submit(client, chat_lines(40, 64, prefix="cancel"), "/v1/chat/completions")

    def some_done() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 2

    assert wait_for(some_done, 120)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    cancelled = wait_final(client, batch.id, timeout_s=60)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    counts = cancelled.request_counts
    assert counts is not None and counts.total == 40 and 2 <= counts.completed < 40 and counts.failed == 0
    assert len(output_lines(client, cancelled.output_file_id)) == counts.completed
    assert wait_for(lambda: server.engine_state()["in_flight"] == 0, 10)
