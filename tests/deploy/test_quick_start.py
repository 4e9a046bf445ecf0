"""The README's quick start as a new user runs it: in a fresh copy of the repository (no .venv, no cached model),
`bash scripts/serve-smollm2.sh` alone sets everything up and serves; the README's client example (chat, then a
stream) runs with that .venv's python against it and prints both answers; a second start answers /health within
15 s, its set-up skipped and the model taken from .cache/models.

Slow: the first start installs torch and every dependency into the new .venv (a few minutes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from loadtest.server import ServerProcess, free_port, spawn

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:7088/v1"
FIRST_START_S = 1800.0  # a fresh .venv: torch and every dependency
SECOND_START_S = 15.0  # the bound for a restart


def readme_client_example(readme: str) -> str:
    """The first Python block of the README's "Using it" section."""
    section = readme.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert block, "the README's Using it section has no Python example"
    return block.group(1)


def fresh_copy(dest: Path) -> Path:
    """The working tree's files as a clone would have them (tracked and new, not ignored: no .venv, no .cache)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell the repository's files from build outputs")
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def new_user_environment() -> dict[str, str]:
    """The environment of a shell outside any virtualenv; one torch thread, as every test on this machine."""
    venv_bin = str(Path(sys.prefix) / "bin")
    # Not the tests' own settings either (tests/conftest.py: CPU_COMPILE): the server's defaults, as a new user has.
    left_out = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CPU_COMPILE")
    env = {k: v for k, v in os.environ.items() if k not in left_out}
    env["PATH"] = os.pathsep.join(part for part in env.get("PATH", "").split(os.pathsep) if part != venv_bin)
    env["PYTHON"] = getattr(sys, "_base_executable", sys.executable)
    env.update(TORCH_THREADS="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


@contextmanager
def serve_script(repo: Path, port: int, log: Path, timeout_s: float) -> Iterator[ServerProcess]:
    """Runs the repository's serve script as a new user would until /health answers (`startup_s`: how long that
    took); stops it and everything it started on the way out."""
    # A K/V pool of a fixed size: by default it is a share of the memory available at start, which the tests running
    # beside this one move, and a pool of another size fails the stored step's guards, so a restart would compile anew.
    command = ["bash", "scripts/serve-smollm2.sh", "--port", str(port), "--kv-cache-memory", "1GiB"]
    with spawn(command, port, log, env=new_user_environment(), cwd=repo, timeout_s=timeout_s) as server:
        yield server


def test_quick_start_from_a_fresh_copy(tmp_path: Path) -> None:
    repo = fresh_copy(tmp_path / "repo")
    assert not (repo / ".venv").exists() and not (repo / ".cache").exists()
    port = free_port()
    example = readme_client_example((repo / "README.md").read_text())
    assert README_URL in example
    script = tmp_path / "client_example.py"
    script.write_text(example.replace(README_URL, f"http://127.0.0.1:{port}/v1"))
    log = tmp_path / "serve.log"

    with serve_script(repo, port, log, FIRST_START_S):
        result = subprocess.run(
            [str(repo / ".venv" / "bin" / "python"), str(script)],
            cwd=repo,
            env=new_user_environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 0, result.stderr
    answer, _, streamed = result.stdout.partition("\n")
    assert "Paris" in answer, result.stdout  # the README's comment on this line
    assert streamed.strip(), f"the stream printed nothing: {result.stdout!r}"

    first_start_end = log.stat().st_size
    with serve_script(repo, port, log, FIRST_START_S) as server:
        seconds = server.startup_s
        assert seconds < SECOND_START_S, f"a second start took {seconds:.1f} s:\n{server.log_tail()}"
    second_start = log.read_bytes()[first_start_end:].decode(errors="replace")
    assert "setting up .venv" not in second_start and "dequantizing" not in second_start, second_start
