"""Compiled steps kept on disk (`runners/step_store.py`): a stored step is loaded, not compiled again, and computes
what its function does; one stored for other shapes fails its guards and is compiled anew (and stored over it); a
file that cannot be read is compiled anew too; the C++ inductor builds for a step is kept beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from transformers_openai.runners.step_store import compiled_step, has_cxx_compiler, store_key

pytestmark = pytest.mark.skipif(
    not has_cxx_compiler(), reason="torch.compile's CPU kernels need a C++ compiler (scripts/test.sh installs g++)"
)


class Weights:
    """What a step reads from its owner rather than from its arguments, as the decode step reads the model."""

    def __init__(self, outputs: int) -> None:
        self.weight = torch.randn(outputs, 8)


def project(owner: Weights, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ owner.weight.T) + 1


def test_a_stored_step_is_loaded_and_computes_its_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))  # restored after
    owner, x = Weights(3), torch.randn(5, 8)
    path = tmp_path / "step.bin"
    first, loaded = compiled_step(project, (owner, x), [(1, 0)], path)
    assert not loaded and path.exists()
    # Inductor's cache beside the stored step, holding the shared library it built for it.
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").rglob("*.so"))
    again, loaded = compiled_step(project, (owner, x), [(1, 0)], path)
    assert loaded
    other_owner, more_rows = Weights(3), torch.randn(9, 8)  # a symbolic batch; new weights of the same shape
    assert torch.allclose(again(other_owner, more_rows), project(other_owner, more_rows))
    assert torch.allclose(first(owner, x), project(owner, x))


def test_a_step_stored_for_other_shapes_or_unreadable_is_compiled_anew(tmp_path: Path) -> None:
    path = tmp_path / "step.bin"
    compiled_step(project, (Weights(3), torch.randn(5, 8)), [], path)
    wider = Weights(6)
    step, loaded = compiled_step(project, (wider, torch.randn(5, 8)), [], path)
    assert not loaded  # its guards on the weight's shape failed
    x = torch.randn(5, 8)
    assert torch.allclose(step(wider, x), project(wider, x))
    assert compiled_step(project, (wider, x), [], path)[1]  # stored over the old one
    path.write_bytes(b"not a compiled step")
    step, loaded = compiled_step(project, (wider, x), [], path)
    assert not loaded and torch.allclose(step(wider, x), project(wider, x))


def test_the_key_names_what_guards_do_not_check() -> None:
    assert store_key(["model a"]) == store_key(["model a"])
    assert store_key(["model a"]) != store_key(["model b"])
