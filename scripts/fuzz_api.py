"""Fuzzes the real server with schemathesis and prints what it found: `python scripts/fuzz_api.py [options]`.

Starts the server on the tiny random Llama the tests use (tests/e2e/server.py's start_server) with
`--max-model-len 64`, so that every generated request is quick (a larger max_tokens gets its 400 at once), runs
`st run` against its /openapi.json with `model` pinned to the served name (a `before_load_schema` hook,
tests/e2e/fuzz_schema.py), a per-request timeout and the checks below, then reads schemathesis's NDJSON event log and
prints: cases, answers by status, 5xx answers, hangs (no answer within the timeout), schema violations, failures by
check, whether the server survived, and the distinct failures with a curl line each. Exit status 1 when there is a
5xx, a hang, a violation or a dead server.

`--max-examples` is per operation and phase (coverage and stateful cases come on top): 300 gives about 5,200 cases
over the 10 operations, in a minute or two on one CPU core. `--source DIR` serves another checkout's package (for
example a `git worktree` of an older commit) with this checkout's tests, hook and script.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

import tests.e2e.server as server_module  # noqa: E402
from tests.model_factory import build_tiny_llama, cache_root  # noqa: E402

GATING = ["not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance"]
VIOLATIONS = {
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
}
SERVER_ARGS = ["--max-model-len", "64", "--max-batch-size", "8"]


@dataclass
class Distinct:
    check: str
    operation: str
    title: str
    message: str
    status: int | None
    count: int = 0
    curl: str = ""
    answer: str = ""


@dataclass
class Findings:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    slowest_s: float = 0.0
    by_check: Counter[str] = field(default_factory=Counter)  # failing responses per check
    distinct: dict[tuple[str, ...], Distinct] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)  # requests without an answer, by exception
    hangs: int = 0


def curl_line(request: dict[str, Any]) -> str:
    """The request exactly as sent (headers schemathesis always sends are left out)."""
    parts = ["curl", "-sS", "-X", request["method"]]
    for name, values in (request.get("headers") or {}).items():
        for value in values if isinstance(values, list) else [values]:
            parts += ["-H", shlex.quote(f"{name}: {value}")]
    body = request.get("body")
    raw = base64.b64decode(body["$base64"]) if isinstance(body, dict) and "$base64" in body else None
    prefix = ""
    if raw is not None:
        text = raw.decode("utf-8", "replace")
        if text.encode() == raw and text.isprintable():
            parts += ["--data-binary", shlex.quote(text)]
        else:  # bytes a shell argument cannot carry (NUL, invalid UTF-8): piped in
            prefix = "printf '%b' " + shlex.quote("".join(f"\\x{byte:02x}" for byte in raw)) + " | "
            parts += ["--data-binary", "@-"]
    return prefix + " ".join(parts + [shlex.quote(request["uri"])])


def read_events(path: Path) -> Findings:
    found = Findings()
    with path.open(encoding="utf-8") as events:
        for line in events:
            event = json.loads(line)
            if "NonFatalError" in event:
                error = event["NonFatalError"].get("value") or {}
                kind = f"{error.get('type', '?')}: {str(error.get('message', ''))[:160]}"
                found.errors[kind] += 1
                if "timeout" in kind.lower() or "timed out" in kind.lower():
                    found.hangs += 1
                continue
            if "ScenarioFinished" not in event:
                continue
            recorder = event["ScenarioFinished"].get("recorder") or {}
            interactions = recorder.get("interactions") or {}
            for interaction in interactions.values():
                found.requests += 1
                response = interaction.get("response")
                if response is None:
                    continue
                found.statuses[response["status_code"]] += 1
                found.slowest_s = max(found.slowest_s, response.get("elapsed") or 0.0)
            for case_id, checks in (recorder.get("checks") or {}).items():
                failed = [check for check in checks if check.get("status") == "failure"]
                for check in {check["name"]: check for check in failed}.values():  # each check once per response
                    found.by_check[check["name"]] += 1
                    failure = (check.get("failure_info") or {}).get("failure") or {}
                    interaction = interactions.get(case_id) or {}
                    response = interaction.get("response") or {}
                    status = response.get("status_code")
                    message = str(failure.get("message", "")).strip()
                    key = (check["name"], failure.get("operation", "?"), str(failure.get("title")), message)
                    if key not in found.distinct:
                        content = response.get("content")
                        answer = ""
                        if isinstance(content, dict) and "$base64" in content:
                            answer = base64.b64decode(content["$base64"]).decode("utf-8", "replace")[:300]
                        found.distinct[key] = Distinct(
                            check["name"],
                            key[1],
                            key[2],
                            message,
                            status,
                            curl=curl_line(interaction["request"]) if "request" in interaction else "",
                            answer=answer,
                        )
                    found.distinct[key].count += 1
    return found


def describe_source(source: Path) -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return f"{source} at {commit}" + (f" plus uncommitted changes in {len(changed)} files" if changed else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-examples",
        type=int,
        default=300,
        help="cases per operation and phase (default 300: about 5,200 cases in all)",
    )
    parser.add_argument("--source", type=Path, default=REPO, help="checkout whose transformers_openai is served")
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout in seconds (a hang)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--checks", default=",".join(GATING), help="schemathesis checks (default: the gating four)")
    parser.add_argument("--report", type=Path, help="folder for schemathesis's output and reports (default: a temp)")
    parser.add_argument("--top", type=int, default=15, help="distinct failures to print")
    args = parser.parse_args()

    source = args.source.resolve()
    report = (args.report or Path(tempfile.mkdtemp(prefix="fuzz-api-"))).resolve()
    report.mkdir(parents=True, exist_ok=True)
    # start_server runs the server in, and puts first on PYTHONPATH, its module's REPO: point it at the source.
    server_module.REPO = source
    model = build_tiny_llama(cache_root() / "tiny-llama")
    server = server_module.start_server(model, report, *SERVER_ARGS)
    ndjson = report / "events.ndjson"
    try:
        command = [
            "st",
            "run",
            f"{server.root_url}/openapi.json",
            "--checks",
            args.checks,
            "--max-examples",
            str(args.max_examples),
            "--request-timeout",
            str(args.timeout),
            "--continue-on-failure",
            "--no-shrink",
            "--seed",
            str(args.seed),
            "--workers",
            "1",
            "--output-sanitize",
            "false",
            "--no-color",
            "--report",
            "ndjson,json",
            "--report-dir",
            str(report),
            "--report-ndjson-path",
            str(ndjson),
            "--report-json-path",
            str(report / "run.json"),
        ]
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.e2e.fuzz_schema",
            "FUZZ_MODEL": server.model,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        print(f"fuzzing {describe_source(source)}; schemathesis output: {report / 'st-output.txt'}", flush=True)
        start = time.monotonic()
        with (report / "st-output.txt").open("wb") as output:
            done = subprocess.run(command, env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, check=False)
        elapsed = time.monotonic() - start
        alive = server.process.poll() is None
        try:
            health: int | str | None = httpx.get(f"{server.root_url}/health", timeout=10).status_code if alive else None
        except httpx.HTTPError as exc:
            health = f"no answer ({type(exc).__name__})"
    finally:
        server.stop()

    if not ndjson.exists():
        print((report / "st-output.txt").read_text(errors="replace")[-4000:])
        print(f"schemathesis wrote no event log (exit {done.returncode})")
        return 1
    found = read_events(ndjson)
    run = json.loads((report / "run.json").read_text()) if (report / "run.json").exists() else {}
    version = run.get("schemathesis_version", "?")
    generated = (run.get("test_cases") or {}).get("generated", "?")
    server_5xx = sum(count for status, count in found.statuses.items() if status >= 500)
    violations = sum(count for check, count in found.by_check.items() if check in VIOLATIONS)
    lines = [
        "",
        f"served: {describe_source(source)}",
        f"schemathesis {version}: seed {args.seed}, {args.max_examples} examples per operation and phase, "
        f"request timeout {args.timeout:g} s, checks {args.checks}; server {' '.join(SERVER_ARGS)}",
        f"cases: {generated} generated, {found.requests} requests sent, in {elapsed:.0f} s "
        f"(schemathesis exit {done.returncode}, stop reason {run.get('stop_reason', '?')})",
        f"answers by status: {dict(sorted(found.statuses.items()))}; slowest answer {found.slowest_s:.2f} s",
        f"5xx answers: {server_5xx}",
        f"hangs (no answer within {args.timeout:g} s): {found.hangs}",
        f"requests without an answer, by error: {dict(found.errors) or 0}",
        f"schema violations (responses): {violations} "
        + str({check: found.by_check[check] for check in sorted(VIOLATIONS) if found.by_check[check]} or ""),
        f"failing responses by check: {dict(found.by_check.most_common()) or 0}",
        f"distinct failures: {len(found.distinct)}",
        f"server after the run: {'alive' if alive else f'exited with {server.process.returncode}'}, /health {health}",
    ]
    ranked = sorted(found.distinct.values(), key=lambda item: (item.check != "not_a_server_error", -item.count))
    for number, item in enumerate(ranked[: args.top], 1):
        message = " | ".join(part.strip() for part in item.message.splitlines() if part.strip())
        lines += [
            f"{number:2}. {item.check} on {item.operation}: {item.title}, {item.count} responses "
            f"(status {item.status}) {message[:300]}",
            f"    answer: {item.answer[:200]!r}",
            f"    {item.curl[:1500]}",
        ]
    if len(ranked) > args.top:
        lines.append(f"... and {len(ranked) - args.top} more: {report / 'st-output.txt'}")
    summary = "\n".join(lines)
    print(summary)
    (report / "summary.txt").write_text(summary + "\n")
    bad = server_5xx or found.hangs or found.errors or violations or found.by_check or not alive
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
