"""The server side of a load run: start our server on loopback (and always stop it), and describe what ran."""

from __future__ import annotations

import ipaddress
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ServerOptions:
    """How to start `python -m transformers_openai.main` for a run."""

    model: Path
    log_path: Path
    torch_threads: int | None = None
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_loopback(url: str) -> bool:
    """True for localhost and loopback IP addresses (127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_command(opts: ServerOptions, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "transformers_openai.main", "--model", str(opts.model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if opts.torch_threads:
        cmd += ["--torch-threads", str(opts.torch_threads)]
    return cmd + list(opts.extra_args)


def get_json(url: str, trust_env: bool = False) -> Any | None:
    """GET a URL and decode its JSON body; None on any failure or non-200."""
    try:
        resp = httpx.get(url, timeout=5.0, trust_env=trust_env)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> None:
    """Poll GET /health until it answers 200; exit if the server dies or takes longer than timeout_s."""
    deadline = time.monotonic() + timeout_s
    while get_json(f"{base_url}/health") is None:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before /health was ready; see {log_path}")
        if time.monotonic() > deadline:
            raise SystemExit(f"server /health not ready after {timeout_s:g} s; see {log_path}")
        time.sleep(0.5)


@contextmanager
def local_server(opts: ServerOptions) -> Iterator[str]:
    """Start our server on a free 127.0.0.1 port, yield its base URL; always stop it (SIGTERM, then SIGKILL)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    if opts.torch_threads:
        env["OMP_NUM_THREADS"] = str(opts.torch_threads)
    with spawned(server_command(opts, port), port, env, opts.log_path, opts.startup_timeout_s) as base_url:
        yield base_url


@contextmanager
def spawned(command: list[str], port: int, env: dict[str, str], log_path: Path, timeout_s: float) -> Iterator[str]:
    """Start any server command that listens on 127.0.0.1:`port` (ours, or a peer such as `transformers serve`);
    yield its base URL once GET /health answers; always stop it and what it spawned."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(base_url, proc, timeout_s, log_path)
            yield base_url
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Signal the process group we started (the server and anything it spawned), then reap it."""
    for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        with suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, sig)
            proc.wait(grace_s)
            return
    proc.poll()


def served_model(base_url: str, fallback: str, trust_env: bool = False) -> str:
    """The first model id of GET /v1/models, else the fallback."""
    models: Any = get_json(f"{base_url}/v1/models", trust_env) or {}
    with suppress(TypeError, KeyError, IndexError, AttributeError):
        return str(models["data"][0]["id"])
    return fallback


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
