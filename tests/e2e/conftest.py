"""Servers for the end-to-end tests, one per model and configuration, shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.server import ServerProcess, start_server


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "--max-batch-size", "8", "--max-queue", "32")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(smollm2_dir, server_logs, "--max-batch-size", "16", "--max-queue", "32")
    yield server
    server.stop()


def sync_client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def async_client(server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
