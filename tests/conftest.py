"""Shared fixtures: test models built without a hub, one torch thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.model_factory import build_tiny_llama, cache_root, export_smollm2  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return build_tiny_llama(cache_root() / "tiny-llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return export_smollm2(cache_root() / "smollm2-135m-instruct")
