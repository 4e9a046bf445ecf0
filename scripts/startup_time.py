"""Times a serve script from launch until GET /health answers 200, then stops it: how long a (re)start takes.

    python scripts/startup_time.py                              # bash scripts/serve-smollm2.sh, twice
    python scripts/startup_time.py --runs 3 -- bash scripts/serve-whisper-tiny-en.sh

The first run may set up .venv and convert the model; the runs after it are the restarts a user waits for.
Standard library only, so it runs before .venv exists. The port is chosen free and passed as `--port`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def serving(
    command: list[str], cwd: Path, log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> Iterator[float]:
    """Runs `command` (a serve script and its arguments, the port among them) until GET /health on `--port`'s port
    answers 200; yields the seconds that took; always stops it and everything it started."""
    port = int(command[command.index("--port") + 1])
    with log.open("ab") as out:
        started = time.monotonic()
        # A session of its own: the serve script execs the server, and anything it spawned goes down with it.
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while not healthy(port):
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{tail(log)}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"no /health after {timeout_s:.0f} s:\n{tail(log)}")
            time.sleep(0.1)
        yield time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per start (default: %(default)s)")
    parser.add_argument("--log", type=Path, default=Path("/tmp/startup_time.log"))
    parser.add_argument("command", nargs="*", default=["bash", "scripts/serve-smollm2.sh"])
    args = parser.parse_args()
    for run in range(1, args.runs + 1):
        with serving([*args.command, "--port", str(free_port())], ROOT, args.log, args.timeout) as seconds:
            print(f"start {run}: /health answered 200 after {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
