"""Our C++ operators (csrc/) built once with the system's compiler against this torch and kept in a directory.

A library is named by a digest of its source, the compiler command, the CPU's flags and torch's version, so a start
loads what an earlier one built for the same CPU and torch, and builds (seconds) only what changed."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import tempfile
from pathlib import Path

import torch

from transformers_openai.runners.steps.step_store import cpu_flags, cxx_compiler

logger = logging.getLogger(__name__)


def compile_command(cxx: str, source: Path, target: Path) -> list[str]:
    """Built against this torch's headers and libraries, as its own C++ operators are."""
    torch_dir = Path(torch.__file__).parent
    libraries = torch_dir / "lib"
    return [
        cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-Wall", "-Wextra",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        # torch's headers as system headers: the warnings asked for are this kernel's own.
        "-isystem", str(torch_dir / "include"),
        "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        "-o", str(target), str(source), f"-L{libraries}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libraries}",
    ]  # fmt: skip


def build_and_load(source_file: Path, prefix: str, directory: Path, what: str) -> bool:
    """Loads the operators of `source_file` into torch: the library `directory` holds for this source, CPU and torch,
    else built there now; False (logged, naming `what`) where there is no compiler or the build or load fails."""
    cxx = cxx_compiler()
    if cxx is None:
        return False
    source_text = source_file.read_text()
    key = [source_text, " ".join(compile_command(Path(cxx).name, Path(), Path())), cpu_flags(), torch.__version__]
    target = directory / f"{prefix}-{hashlib.sha256(chr(0).join(key).encode()).hexdigest()[:24]}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                source, built = Path(scratch) / "kernel.cpp", Path(scratch) / "kernel.so"
                source.write_text(source_text)  # the digested text, whatever happens to the package's file meanwhile
                done = subprocess.run(
                    compile_command(cxx, source, built), check=True, capture_output=True, text=True, timeout=600
                )
                if done.stderr.strip():  # built with -Wall -Wextra: a warning here is a finding in the kernel
                    logger.warning("the %s built with compiler warnings:\n%s", what, done.stderr)
                built.replace(target)  # atomic: a start beside this one sees the whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("the %s could not be built: %s", what, detail)
            return False
    try:
        torch.ops.load_library(str(target))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        logger.warning("the %s could not be loaded: %s", what, exc)
        return False
    return True
