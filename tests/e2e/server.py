"""Starts `python -m transformers_openai.main` as a subprocess on a free loopback port and waits for /health."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    model: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict:
        return httpx.get(f"{self.root_url}/health", timeout=10).json()

    def engine_state(self) -> dict:
        return self.health()["engine"]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    model: Path, log_dir: Path, *args: str, timeout_s: float = 180, env_overrides: dict[str, str] | None = None
) -> ServerProcess:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
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
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = ServerProcess(process, port, "test-model", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.root_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"server not healthy after {timeout_s}s:\n{server.log()}")


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
