"""Fixtures for the in-process app tests: the real tiny tokenizer, a FakeEngine and a ready client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.app.fake_engine import FakeEngine
from tests.app.support import make_app, running


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def bert_tokenizer(minilm_dir: Path) -> Any:
    """MiniLM's tokenizer: it makes token types for pairs, as BERT cross-encoders read them."""
    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The Batch API's --data-dir of every app test: a temporary folder, never the user's cache."""
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "batch-data"))
    return tmp_path / "batch-data"


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with running(make_app(fake, hf_tokenizer)) as ready:
        yield ready
