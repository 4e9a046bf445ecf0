"""Servers for the end-to-end tests, one per model and configuration, shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.server import ServerProcess, start_server
from tests.model_factory import build_tiny_lora, build_tiny_t5, build_whisper_lora, cache_root

TOOL_TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-tools.jinja"


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "--max-batch-size", "8", "--max-queue", "32")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_t5_dir() -> Path:
    return build_tiny_t5(cache_root() / "tiny-t5")


@pytest.fixture(scope="session")
def tiny_t5_lora(tiny_t5_dir: Path) -> Path:
    """A LoRA adapter made with PEFT on the tiny T5's query and value projections (encoder, decoder, cross)."""
    from loadtest.lora_adapters import T5_TARGETS

    return build_tiny_lora(cache_root() / "tiny-t5-lora", tiny_t5_dir, seed=1, targets=T5_TARGETS)


@pytest.fixture(scope="session")
def tiny_t5_server(tiny_t5_dir: Path, tiny_t5_lora: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """The tiny T5, with the LoRA adapter `t5-a` (requests naming the model never use it)."""
    lora = ["--lora-modules", f"t5-a={tiny_t5_lora}"]
    server = start_server(tiny_t5_dir, server_logs, "--max-batch-size", "8", "--max-queue", "32", *lora)
    yield server
    server.stop()


@dataclass
class Served:
    """A running server and the model directory behind it."""

    server: ServerProcess
    model_dir: Path
    kind: str


@pytest.fixture(params=["causal-lm", "seq2seq"])
def served(request: pytest.FixtureRequest) -> Served:
    """The same end-to-end test against each model kind (tiny random models)."""
    if request.param == "seq2seq":
        return Served(request.getfixturevalue("tiny_t5_server"), request.getfixturevalue("tiny_t5_dir"), "seq2seq")
    return Served(request.getfixturevalue("tiny_server"), request.getfixturevalue("tiny_llama_dir"), "causal-lm")


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """SmolLM2 with the repo's tool template (rendering as the model's own when a request has no tools)."""
    server = start_server(
        smollm2_dir, server_logs, "--max-batch-size", "16", "--max-queue", "32", "--chat-template", str(TOOL_TEMPLATE)
    )
    yield server
    server.stop()


def sync_client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def async_client(server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def whisper_loras(whisper_dir: Path) -> Path:
    """Two LoRA adapters made with PEFT on Whisper tiny.en (`a`, `b`), in a folder adapters may be loaded from."""
    root = cache_root() / "whisper-tiny-en-loras"
    for name, seed in (("a", 1), ("b", 3)):
        build_whisper_lora(root / name, whisper_dir, seed=seed)
    return root


@pytest.fixture(scope="session")
def whisper_server(whisper_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """Whisper tiny.en; a 3 MB upload limit so that the 413 is cheap to reach."""
    server = start_server(whisper_dir, server_logs, "--max-batch-size", "16", "--max-audio-bytes", "3000000")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def multilingual_whisper_server(whisper_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """A tiny random Whisper that is multilingual: language detection and translation run, on random text."""
    from tests.model_factory import build_tiny_multilingual_whisper

    model_dir = build_tiny_multilingual_whisper(cache_root() / "tiny-whisper-multilingual", whisper_dir)
    server = start_server(model_dir, server_logs, "--max-batch-size", "4")
    yield server
    server.stop()
