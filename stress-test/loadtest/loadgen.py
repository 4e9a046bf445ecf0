"""Load generator for an OpenAI-compatible server (by default our own, started on loopback).

Two ways to apply load, each run as a sweep of levels, one level after another:

* closed loop (`--concurrency C` or `--concurrencies 1,2,4`): C simulated users, each sends a request,
  waits for the whole answer, and sends the next one at once;
* open loop (`--rate R` or `--rates 0.5,1,2`): requests arrive as a Poisson process of R requests/s,
  whether or not earlier ones have finished (this is how queues build up and 429s appear).

A level stops issuing new requests after `--duration` seconds or `--max-requests` requests, whichever
comes first, then waits for the requests in flight (each bounded by `--request-timeout`). The whole run
is bounded by `--time-limit`: requests still in flight then are cancelled and counted as "cancelled".

Workloads (`--workload`): chat-stream (streamed /v1/chat/completions), chat (non-streamed, so no
TTFT/ITL), completions (streamed /v1/completions) and transcription (streamed /v1/audio/transcriptions
of the clips in `--audio-dir`, in turn; TTFT is the first text delta, throughput seconds of audio per
second). Requests carry `ignore_eos: true` (turn it off
with `--no-ignore-eos`), so each one yields exactly `--max-tokens` tokens.

Measured per request: TTFT (send -> first chunk carrying text), inter-token latencies (gaps between
text chunks), E2E latency, output tokens (the usage count), and status (ok, http_<code>, timeout,
connection, stream_error, empty, cancelled, client_overflow). The JSON summary (`--out`) holds, per
level, TTFT/ITL/TPOT/E2E p50/p90/p99 in ms, output tokens/s, requests/s and errors by kind (429s also
as `rejected_429`), plus the run's config, model, server version and machine. `--raw-out` also saves
every request. Plot summaries with `loadtest plot`.

Server: without `--url`, `python -m transformers_openai.main --model DIR` is started on a free
127.0.0.1 port and killed at the end. With `--url`, only loopback URLs are accepted unless
`--allow-remote` is given, which is meant for pointing at your own deployment (e.g. a GPU host:
`--url http://gpu-host:7088 --allow-remote`). Note: the client shares the CPU with a local server.

Examples:
    loadtest run --model .cache/models/smollm2-135m-instruct --concurrencies 1,2,4,8,16
    loadtest run --url http://127.0.0.1:7088 --rates 0.5,1,2,4 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.loadclient import WORKLOADS, RequestSpec, load_clips, pick_prompt, send
from loadtest.loadlevels import LevelRun, closed_loop, open_loop
from loadtest.loadstats import RequestRecord, markdown_table, progress_line, record_to_json, summarize_level
from loadtest.server import ServerOptions, is_loopback, local_server, machine_info, served_model, server_version

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "transformers-openai-api/stress-test/1"


# ----------------------------------------------------------------------------- one level


@dataclass
class LevelResult:
    """A finished level: its JSON summary and every request's record."""

    summary: dict[str, Any]
    records: list[RequestRecord]


async def run_level(
    args: argparse.Namespace, base_url: str, spec: RequestSpec, load: float, deadline: float
) -> LevelResult:
    """Run one level (closed loop when mode is concurrency, else open loop) and summarize it."""
    limits = httpx.Limits(max_connections=int(max(load, 1)) + 4 if args.mode == "concurrency" else args.max_in_flight)
    async with http_client(args, limits) as client:
        stop_issuing_at = min(time.perf_counter() + args.duration, deadline)
        run = LevelRun(client, base_url, spec, args.request_timeout, stop_issuing_at, args.max_requests)
        if args.mode == "concurrency":
            work: Awaitable[None] = closed_loop(run, int(load), args.backoff_cap)
        else:
            work = open_loop(run, load, random.Random(args.seed), args.max_in_flight)
        with suppress(asyncio.TimeoutError):  # noqa: UP041 - asyncio's is distinct before 3.11
            await asyncio.wait_for(work, max(deadline - time.perf_counter(), 0.01))
    stopped_by = run.stopped_by(deadline)
    summary = summarize_level(args.mode, load, run.records, issue_window_s=run.issue_window_s(), stopped_by=stopped_by)
    return LevelResult(summary, run.records)


def http_client(args: argparse.Namespace, limits: httpx.Limits) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, trust_env=args.allow_remote)


async def warm_up(args: argparse.Namespace, base_url: str, spec: RequestSpec) -> None:
    """A few unrecorded requests; fails the run early when none succeeds."""
    if args.warmup <= 0:
        return
    async with http_client(args, httpx.Limits(max_connections=2)) as client:
        records = [
            await send(client, base_url, spec.for_request(i), pick_prompt(i, spec.prompts), args.request_timeout)
            for i in range(args.warmup)
        ]
    if not any(r.ok for r in records):
        raise SystemExit(f"warm-up failed: {records[0].status}: {records[0].detail}")


async def sweep(args: argparse.Namespace, base_url: str, spec: RequestSpec, deadline: float) -> list[LevelResult]:
    await warm_up(args, base_url, spec)
    levels: list[LevelResult] = []
    for load in args.levels:
        if time.perf_counter() >= deadline:
            log(f"{args.mode}={load:g}: skipped, run time limit reached")
            continue
        level = await run_level(args, base_url, spec, load, deadline)
        log(progress_line(level.summary))
        levels.append(level)
    return levels


# ----------------------------------------------------------------------------- report


def shown_path(path: Path) -> str:
    """A path relative to the repository when inside it (so that committed summaries carry no home paths)."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    hidden = {"api_key", "levels"}
    config = {k: shown_path(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in hidden}
    return config | {"api_key": "***" if args.api_key else None}


def write_outputs(args: argparse.Namespace, report: dict[str, Any], levels: list[LevelResult]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    if args.raw_out:
        raw = [{"load": lv.summary["load"], "requests": [record_to_json(r) for r in lv.records]} for lv in levels]
        args.raw_out.parent.mkdir(parents=True, exist_ok=True)
        args.raw_out.write_text(json.dumps({"mode": args.mode, "levels": raw}) + "\n")
        log(f"wrote {args.raw_out}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- command line


def number_list(kind: type) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    load = p.add_argument_group("load (exactly one)").add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop with this many users")
    load.add_argument("--concurrencies", type=number_list(int), help="closed-loop sweep, e.g. 1,2,4,8,16")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    load.add_argument("--rates", type=number_list(float), help="open-loop sweep, e.g. 0.5,1,2,4")
    lim = p.add_argument_group("bounds")
    lim.add_argument("--duration", type=float, default=30.0, help="seconds of issuing per level (default: %(default)s)")
    lim.add_argument(
        "--max-requests", type=int, default=10_000, help="requests per level at most (default: %(default)s)"
    )
    lim.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default: %(default)s)")
    lim.add_argument(
        "--time-limit", type=float, default=1800.0, help="seconds for the whole run (default: %(default)s)"
    )
    lim.add_argument(
        "--max-in-flight", type=int, default=512, help="open loop: more are not sent (default: %(default)s)"
    )
    lim.add_argument(
        "--backoff-cap",
        type=float,
        default=1.0,
        help="closed loop: longest pause after a failure, which waits Retry-After or 0.1 s (default: %(default)s)",
    )
    req = p.add_argument_group("requests")
    req.add_argument("--workload", choices=WORKLOADS, default="chat-stream", help="(default: %(default)s)")
    req.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default: %(default)s)")
    req.add_argument(
        "--audio-dir",
        type=Path,
        default=REPO_ROOT / "tests" / "data" / "audio",
        help="transcription: the clips to upload (default: tests/data/audio)",
    )
    req.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    req.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so that every answer has --max-tokens tokens (default: on)",
    )
    req.add_argument("--warmup", type=int, default=2, help="unrecorded requests before the first level (default: 2)")
    req.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default: %(default)s)")
    srv = p.add_argument_group("server")
    srv.add_argument(
        "--model",
        type=Path,
        default=REPO_ROOT / ".cache/models/smollm2-135m-instruct",
        help="model directory of the server started here (default: %(default)s)",
    )
    srv.add_argument("--url", help="use this running server instead (base URL, e.g. http://127.0.0.1:7088)")
    srv.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --url: only for your own deployment, e.g. a GPU host",
    )
    srv.add_argument("--model-name", help="`model` to send (default: first id of GET /v1/models)")
    srv.add_argument(
        "--models",
        type=lambda text: [name for name in text.split(",") if name],
        help="round-robin `model` over these names, e.g. LoRA adapters a,b,c,d (overrides --model-name)",
    )
    srv.add_argument(
        "--api-key", default=os.environ.get("STRESS_API_KEY"), help="Bearer key (default: $STRESS_API_KEY)"
    )
    srv.add_argument("--torch-threads", type=int, help="spawned server: --torch-threads and OMP_NUM_THREADS")
    srv.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for the spawned server; repeatable (use --server-arg=--max-batch-size=8)",
    )
    srv.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health (default: 300)")
    srv.add_argument("--server-log", type=Path, help="spawned server's log (default: next to --out, *.server.log)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, help="JSON summary (default: results/summary-<mode>.json)")
    out.add_argument("--raw-out", type=Path, help="also write every request's record to this JSON file")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency or args.concurrencies:
        args.mode, args.levels = "concurrency", args.concurrencies or [args.concurrency]
    else:
        args.mode, args.levels = "rate", args.rates or [args.rate]
    if any(v <= 0 for v in args.levels) or min(args.duration, args.request_timeout, args.time_limit) <= 0:
        parser.error("levels, --duration, --request-timeout and --time-limit must be positive")
    if args.max_requests < 1 or args.max_in_flight < 1:
        parser.error("--max-requests and --max-in-flight must be at least 1")
    if args.url:
        args.url = args.url.rstrip("/").removesuffix("/v1")
        if not (args.allow_remote or is_loopback(args.url)):
            parser.error(f"{args.url} is not a loopback address; pass --allow-remote if it is your own deployment")
    else:
        args.model = args.model.resolve()
        if not (args.model / "config.json").exists():
            parser.error(f"--model {args.model} is not a model directory (no config.json); or give --url")
    args.out = args.out or Path("results") / f"summary-{args.mode}.json"
    args.server_log = args.server_log or args.out.with_suffix(".server.log")
    return args


async def run_all(args: argparse.Namespace, base_url: str, deadline: float) -> tuple[dict[str, Any], list[LevelResult]]:
    """Sweep all levels against base_url; the JSON report and the levels' records."""
    model = args.model_name or served_model(base_url, shown_path(args.model), args.allow_remote)
    clips = load_clips(args.audio_dir) if args.workload == "transcription" else ()
    models = tuple(args.models or ())
    spec = RequestSpec(args.workload, model, args.max_tokens, args.temperature, args.ignore_eos, clips, models)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")  # noqa: UP017 - runs on 3.10
    machine = machine_info(args.url is None, args.torch_threads)  # before the load: its load average is others'
    levels = await sweep(args, base_url, spec, deadline)
    report = {
        "schema": SCHEMA,
        "started": started,
        "mode": args.mode,
        "model": model,
        "models": list(models),
        "server": {
            "url": base_url if is_loopback(base_url) else "(remote)",
            "version": server_version(base_url, args.allow_remote),
        },
        "machine": machine,
        "config": run_config(args),
        "levels": [level.summary for level in levels],
    }
    return report, levels


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every request of every level succeeded, else 1."""
    args = parse_args(argv)
    deadline = time.perf_counter() + args.time_limit
    if args.url:
        report, levels = asyncio.run(run_all(args, args.url, deadline))
    else:
        opts = ServerOptions(
            Path(shown_path(args.model)), args.server_log, args.torch_threads, args.server_arg, args.startup_timeout
        )
        with local_server(opts) as base_url:
            log(f"server ready at {base_url} (log: {args.server_log})")
            report, levels = asyncio.run(run_all(args, base_url, deadline))
    write_outputs(args, report, levels)
    print(markdown_table(report["levels"]))
    return 0 if all(level["failed"] == 0 for level in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
