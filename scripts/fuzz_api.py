"""Fuzzes the real server with schemathesis: `python scripts/fuzz_api.py [--max-examples N] [--report DIR]`.

Starts the server on the tiny random Llama (the test suite's way, tests/e2e/server.py) with a short context so
generated requests stay quick, runs `st run` against its /openapi.json with `model` pinned to the served name
(tests/e2e/fuzz_schema.py), and prints schemathesis's summary: failures by check (server errors, status code,
content type and response schema conformance) and requests that timed out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.server import start_server  # noqa: E402
from tests.model_factory import build_tiny_llama, cache_root  # noqa: E402

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-examples", type=int, default=300, help="examples per operation and phase (300: over 5,000 cases)"
    )
    parser.add_argument("--report", type=Path, help="folder for schemathesis's JSON report")
    args = parser.parse_args()
    model = build_tiny_llama(cache_root() / "tiny-llama")
    logs = Path(tempfile.mkdtemp(prefix="fuzz-logs-"))
    server = start_server(model, logs, "--max-model-len", "64", "--max-batch-size", "8")
    try:
        command = [
            "st", "run", f"{server.root_url}/openapi.json", "--checks", CHECKS,
            "--max-examples", str(args.max_examples), "--request-timeout", "30", "--continue-on-failure",
            "--no-shrink", "--seed", "7",
        ]
        if args.report:
            command += ["--report", "json", "--report-dir", str(args.report)]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.fuzz_schema", "FUZZ_MODEL": server.model,
               "PYTHONPATH": str(REPO)}
        start = time.monotonic()
        done = subprocess.run(command, env=env, cwd=REPO, check=False)
        print(f"\n{time.monotonic() - start:.0f}s; server log: {server.log_path}; "
              f"server still running: {server.process.poll() is None}")
        return done.returncode
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
