"""Times a serve script from launch until GET /health answers 200, then stops it: how long a (re)start takes.

    python scripts/startup_time.py                              # bash scripts/serve-smollm2.sh, twice
    python scripts/startup_time.py --runs 3 -- bash scripts/serve-whisper-tiny-en.sh

The first run may set up .venv and convert the model; the runs after it are the restarts a user waits for.
Needs the `loadtest` package (stress-test/, installed into .venv by `EXTRAS=test scripts/env.sh` or
`pip install -e stress-test --no-deps`): its spawner starts the script in a session of its own, on a free port
passed as `--port`, and stops it and everything it started.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadtest.server import free_port, spawn

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per start (default: %(default)s)")
    parser.add_argument("--log", type=Path, default=Path("/tmp/startup_time.log"))
    parser.add_argument("command", nargs="*", default=["bash", "scripts/serve-smollm2.sh"])
    args = parser.parse_args()
    for run in range(1, args.runs + 1):
        port = free_port()
        with spawn([*args.command, "--port", str(port)], port, args.log, cwd=ROOT, timeout_s=args.timeout) as server:
            print(f"start {run}: /health answered 200 after {server.startup_s:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
