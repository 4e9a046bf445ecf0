"""The one way to start our server (or a peer) for a test or a load run: a free loopback port, a process group of its
own, /health polled until it answers 200, and always stopped; plus what a run reports about the server it ran."""

from __future__ import annotations

import ipaddress
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

# The checkout this package is installed from (editable): the default model and audio paths lie under it.
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A server started by `spawn`: its process (the leader of a process group of its own), port and log; as a
    context manager, stopped on the way out."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str = ""
    startup_s: float = 0.0  # from launch until /health first answered 200

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def health(self) -> Any:
        return httpx.get(f"{self.root_url}/health", timeout=10, trust_env=False).json()

    def engine_state(self) -> Any:
        return self.health()["engine"]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the process group (the server and anything it spawned), SIGKILL after 20 s; then reap."""
        for sig, grace_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
            with suppress(ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                os.killpg(self.process.pid, sig)
                self.process.wait(grace_s)
                return
        self.process.poll()


def healthy(root_url: str) -> bool:
    try:
        return httpx.get(f"{root_url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def spawn(
    command: Sequence[str],
    port: int,
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 180.0,
    model: str = "",
) -> ServerProcess:
    """Start `command` (a server that listens on 127.0.0.1:`port`: ours, a serve script, or a peer such as
    `transformers serve`) in a session of its own, its output appended to `log_path`; return once GET /health
    answers 200 (`with spawn(...) as server:` stops it on the way out). Raises RuntimeError with the log's tail (the
    process group stopped) if it exits or is not healthy within `timeout_s`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        started = time.monotonic()
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServerProcess(process, port, log_path, model)
    while not healthy(server.root_url):
        if process.poll() is not None:
            server.stop()
            raise RuntimeError(f"server exited with {process.returncode} before /health answered:\n{server.log_tail()}")
        if time.monotonic() - started > timeout_s:
            server.stop()
            raise RuntimeError(f"server /health not ready after {timeout_s:g} s:\n{server.log_tail()}")
        time.sleep(0.1)
    server.startup_s = time.monotonic() - started
    return server


def server_command(model: Path | str, port: int, *args: str, torch_threads: int | None = None) -> list[str]:
    """`python -m transformers_openai.main` on `model`, listening on 127.0.0.1:`port`."""
    cmd = [sys.executable, "-m", "transformers_openai.main", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if torch_threads:
        cmd += ["--torch-threads", str(torch_threads)]
    return cmd + list(args)


@dataclass
class ServerOptions:
    """How to start `python -m transformers_openai.main` for a load run."""

    model: Path
    log_path: Path
    torch_threads: int | None = None
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0


@contextmanager
def local_server(opts: ServerOptions) -> Iterator[str]:
    """Our server on a free 127.0.0.1 port for a load run; yields its root URL; always stopped."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    if opts.torch_threads:
        env["OMP_NUM_THREADS"] = str(opts.torch_threads)
    command = server_command(opts.model, port, *opts.extra_args, torch_threads=opts.torch_threads)
    with spawn(command, port, opts.log_path, env=env, timeout_s=opts.startup_timeout_s) as server:
        yield server.root_url


def is_loopback(url: str) -> bool:
    """True for localhost and loopback IP addresses (127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def get_json(url: str, trust_env: bool = False) -> Any | None:
    """GET a URL and decode its JSON body; None on any failure or non-200."""
    try:
        resp = httpx.get(url, timeout=5.0, trust_env=trust_env)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def served_model(base_url: str, fallback: str, trust_env: bool = False) -> str:
    """The first model id of GET /v1/models, else the fallback."""
    models: Any = get_json(f"{base_url}/v1/models", trust_env) or {}
    with suppress(TypeError, KeyError, IndexError, AttributeError):
        return str(models["data"][0]["id"])
    return fallback


def _gauges(root_url: str, names: Sequence[str]) -> dict[str, float]:
    """The values of the named gauges (any labels, the last line of each) on GET /metrics; {} on failure."""
    try:
        text = httpx.get(f"{root_url}/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0].rsplit(":", 1)[-1]
        if name in names and not line.startswith("#"):
            found[name] = float(line.split()[-1])
    return found


def wait_compiled(root_url: str, timeout_s: float) -> None:
    """Waits (at most `timeout_s`) while the server makes its compiled decode step in the background (`/metrics`
    `decode_step_compiling`: eager steps and a compiler share the cores meanwhile), so that a run measures the step
    the server keeps: its next step swaps it in (a warm-up request). At once for a server or peer without the gauge."""
    deadline = time.monotonic() + timeout_s
    while _gauges(root_url, ("decode_step_compiling",)).get("decode_step_compiling") == 1.0:
        if time.monotonic() >= deadline:
            return
        time.sleep(2)


def runs_compiled(root_url: str) -> bool:
    """Whether the server's decode steps run compiled (`/metrics` `decode_step_compiled`; False without it)."""
    return _gauges(root_url, ("decode_step_compiled",)).get("decode_step_compiled") == 1.0


def server_version(base_url: str, trust_env: bool = False) -> str | None:
    """Title and version from the server's OpenAPI document (FastAPI servers publish one), else None."""
    spec: Any = get_json(f"{base_url}/openapi.json", trust_env) or {}
    with suppress(TypeError, KeyError, AttributeError):
        return f"{spec['info']['title']} {spec['info']['version']}"
    return None


def _package_version(name: str) -> str | None:
    with suppress(PackageNotFoundError):
        return version(name)
    return None


def _cpu_model() -> str | None:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def machine_info(spawned: bool, torch_threads: int | None) -> dict[str, Any]:
    """The machine the load generator ran on (also the server's when it was spawned here)."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "server_spawned_here": spawned,
        "server_torch_threads": torch_threads,
        "load_average_1m_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "torch": _package_version("torch"),
        "transformers": _package_version("transformers"),
        "httpx": _package_version("httpx"),
    }
