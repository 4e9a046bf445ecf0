"""Compiled steps kept on disk (`step_store.py`): a stored step is loaded, not compiled again, and computes
what its function does; one stored for other shapes fails its guards and is compiled anew (and stored over it); a
file that cannot be read is compiled anew too; one stored under another torch thread count is loaded; the key hashes
the source of the modules the step's trace goes through, not the whole package; the C++ inductor builds for a step
is kept beside it. Guards on a model's module structure are not stored, those on its weights are; a compile records
which instruction sets inductor's probe accepted, and a later start on a CPU reporting those same sets is spared the
probe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import VecISA, valid_vec_isa_list

from transformers_openai import settings
from transformers_openai.runners.steps import fixed_steps, step_store
from transformers_openai.runners.steps.step_store import (
    VEC_ISA_RECORD,
    compiled_step,
    has_cxx_compiler,
    store_key,
    stored_step,
    traced_sources,
    trust_recorded_vec_isas,
    usable_vec_isas,
)

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
    """Stored under one torch thread, loaded under two (the thread count is not part of what it was compiled
    for); the rest of torch's global state is: grad mode differing, the stored step is not used."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))  # restored after
    owner, x = Weights(3), torch.randn(5, 8)
    path = tmp_path / "step.bin"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first, loaded = compiled_step(project, (owner, x), [(1, 0)], path)
        assert not loaded and path.exists()
        # Inductor's cache beside the stored step, holding the shared library it built for it.
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
        assert any((tmp_path / "inductor").rglob("*.so"))
        torch.set_num_threads(2)
        again, loaded = compiled_step(project, (owner, x), [(1, 0)], path)
        assert loaded
        with torch.no_grad():
            assert stored_step(project, (owner, x), path) is None
    finally:
        torch.set_num_threads(threads)
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


def test_the_key_hashes_the_traced_modules_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change to a module the step's trace goes through changes the key; one to another module does not (the
    package's other files are not read)."""
    sources = traced_sources()
    assert Path(fixed_steps.__file__).resolve() in sources
    assert Path(settings.__file__).resolve() not in sources
    copies = {}
    for source in sources:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        copies[source] = copy
    monkeypatch.setattr(step_store, "PACKAGE", tmp_path)
    monkeypatch.setattr(step_store, "traced_sources", lambda modules: sorted(copies.values()))
    before = store_key(["model a"])
    copies[Path(fixed_steps.__file__).resolve()].write_text("# changed\n")
    assert store_key(["model a"]) != before


class Layers(torch.nn.Module):
    """A model-like owner: weights inside submodules."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, outputs))


def run_layers(owner: Layers, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = owner.body(x)
    return out


@torch.no_grad()
def test_a_stored_module_step_keeps_its_guards_on_weights(tmp_path: Path) -> None:
    path = tmp_path / "step.bin"
    x = torch.randn(4, 8)
    compiled_step(run_layers, (Layers(3), x), [], path)
    same = Layers(3)  # other weights, the same structure: loaded, and computes with these weights
    step, loaded = compiled_step(run_layers, (same, x), [], path)
    assert loaded and torch.allclose(step(same, x), run_layers(same, x))
    wider = Layers(5)  # a weight deep in the module tree of another shape: its guard rejects the stored step
    step, loaded = compiled_step(run_layers, (wider, x), [], path)
    assert not loaded and torch.allclose(step(wider, x), run_layers(wider, x))


def forget_the_instruction_sets() -> None:
    """Inductor's decisions of this process on which instruction sets it may use (the list and each set's probe)."""
    valid_vec_isa_list.cache_clear()
    VecISA._VecISA__bool__impl.cache_clear()  # type: ignore[attr-defined]


def test_a_recorded_probe_of_the_instruction_sets_spares_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forget_the_instruction_sets()
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        reported = usable_vec_isas()  # what this CPU reports, unprobed
    forget_the_instruction_sets()
    probed: list[str] = []

    def probe(isa: VecISA, code: str) -> bool:
        probed.append(str(isa))
        return True

    monkeypatch.setattr(VecISA, "check_build", probe)
    try:
        (tmp_path / VEC_ISA_RECORD).write_text(reported)
        trust_recorded_vec_isas(tmp_path)
        assert usable_vec_isas() == reported and not probed  # decided for the process, without a probe
        forget_the_instruction_sets()
        (tmp_path / VEC_ISA_RECORD).write_text(reported + "sets of another CPU\n")
        trust_recorded_vec_isas(tmp_path)
        assert usable_vec_isas() == reported and probed  # inductor probed again
        forget_the_instruction_sets()
        (tmp_path / VEC_ISA_RECORD).unlink()
        trust_recorded_vec_isas(tmp_path)
        assert valid_vec_isa_list.cache_info().currsize == 0  # nothing recorded: nothing decided
    finally:
        forget_the_instruction_sets()  # the next compile in this process probes for real


def test_a_compile_records_the_instruction_sets_inductor_accepted(tmp_path: Path) -> None:
    compiled_step(project, (Weights(3), torch.randn(5, 8)), [], tmp_path / "step.bin")
    assert (tmp_path / VEC_ISA_RECORD).read_text() == usable_vec_isas()
