"""The e2e tests' server: our server with the tests' settings, started by `loadtest.server` (the one spawner)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from loadtest.server import ServerProcess, free_port, spawn

__all__ = ["REPO", "ServerProcess", "free_port", "replicas_of", "start_server", "wait_for"]

# The checkout whose transformers_openai is served (scripts/fuzz_api.py points it at another one).
REPO = Path(__file__).resolve().parents[2]


def start_server(
    model: Path, log_dir: Path, *args: str, timeout_s: float = 180, env_overrides: dict[str, str] | None = None
) -> ServerProcess:
    """Our server on `model` as the tests run it (CPU, float32, one torch thread, served as `test-model`), from
    REPO, on a free port; returns once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_overrides or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "transformers_openai.main",
        "--model",
        str(model),
        "--served-model-name",
        "test-model",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--torch-threads",
        "1",
        *args,
    ]
    log_path = log_dir / f"server-{port}.log"
    return spawn(command, port, log_path, env=env, cwd=REPO, timeout_s=timeout_s, model="test-model")


@contextmanager
def replicas_of(model: Path, log_dir: Path, names: Sequence[str], *args: str) -> Iterator[dict[str, ServerProcess]]:
    """A server per name (its `--replica-id`), started side by side; all stopped on the way out, and all stopped if
    one fails to start (the first failure raised once every start is over)."""
    started: dict[str, ServerProcess] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            started[name] = start_server(model, log_dir, "--replica-id", name, *args)
        except BaseException as exc:
            errors.append(exc)

    starters = [threading.Thread(target=start, args=(name,)) for name in names]
    for starter in starters:
        starter.start()
    for starter in starters:
        starter.join()
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        for replica in started.values():
            replica.stop()


def wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    """Whether `check` comes true within `timeout_s` (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False
