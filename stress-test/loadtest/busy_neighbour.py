"""Output beside a busy neighbour: running servers driven at a fixed concurrency while a process spinning on one core
starts and stops beside them.

Each episode (one server, one concurrency) is a closed loop of streaming chats (`ignore_eos`, exactly
`--max-tokens` tokens each) that runs through three phases of `--phase-s` seconds: free cores, then a neighbour
process spinning on one core (pinned with `os.sched_setaffinity`, `--core`, default the last CPU this process may
use), then free again. Output tokens are counted by the arrival time of their streamed chunks, so each phase gets
its own tokens/s, and the phase after the neighbour gets one figure per second: recovery is the time from the
neighbour's stop until two seconds in a row reach `--recovered` of the free phase's rate. Episodes are interleaved:
for each repetition, each concurrency, each server in turn. The report gives each phase's tokens/s, busy and after
against free, the recovery time, the fallbacks the server's /metrics counted (ours only), and the load of the
machine (the neighbour aside) when each episode began, from /proc/loadavg and `ps`.

Start the servers first (any loopback URLs), e.g. this checkout and an older one:
    python -m transformers_openai.main --model /tmp/smollm2 --port 7412 &
    (cd /tmp/old && python -m transformers_openai.main --model /tmp/smollm2 --port 7411 &)
    loadtest neighbour --url new=http://127.0.0.1:7412 --url old=http://127.0.0.1:7411 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.loadclient import PROMPTS, chunk_text, pick_prompt
from loadtest.server import is_loopback, served_model

SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
FALLBACKS = "transformers_openai:engine_thread_fallbacks_total"


@dataclass
class Episode:
    """One server at one concurrency through the three phases; tokens/s per phase and per second after."""

    target: str
    concurrency: int
    repeat: int
    free_tps: float = 0.0
    busy_tps: float = 0.0
    after_tps: float = 0.0
    busy_ratio: float = 0.0
    after_ratio: float = 0.0
    recovery_s: float | None = None  # None: not back within the phase
    fallbacks: float | None = None  # counted by the server's /metrics during the episode (ours only)
    errors: int = 0
    after_per_s: list[float] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)


@contextmanager
def busy_neighbour(core: int) -> Iterator[subprocess.Popen[bytes]]:
    """A process spinning on `core` for the duration of the block; always stopped."""
    process = subprocess.Popen([sys.executable, "-c", SPIN, str(core)], stdin=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.terminate()
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        if process.poll() is None:
            process.kill()
            process.wait()


def machine_load() -> dict[str, Any]:
    """The load average and the busiest processes now: what else ran beside the measurement."""
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    try:
        ps = subprocess.run(
            ["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.splitlines()[1:6]
    except (OSError, subprocess.TimeoutExpired):
        ps = []
    return {"loadavg": load, "top": [line.strip() for line in ps]}


def fallbacks(root_url: str) -> float | None:
    """The server's fallback counter (None: a server without it)."""
    try:
        text = httpx.get(f"{root_url}/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(FALLBACKS + "{")]
    return sum(values) if values else None


async def stream_tokens(client: httpx.AsyncClient, url: str, body: dict[str, Any], stamps: list[float]) -> bool:
    """One streamed chat; the arrival time of each text chunk goes to `stamps`. False on an error."""
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return False
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                if chunk_text(json.loads(line[5:]), chat=True):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError:
        return False
    return True


async def closed_loop(
    args: argparse.Namespace, root_url: str, concurrency: int, stamps: list[float]
) -> tuple[int, float]:
    """Keeps `concurrency` chats in flight through the three phases; returns (errors, the neighbour's stop time)."""
    model = served_model(root_url, "model")
    url = f"{root_url}/v1/chat/completions"
    errors = 0
    issued = 0

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal errors, issued
        while True:
            prompt = pick_prompt(issued, PROMPTS)
            issued += 1
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            if not await stream_tokens(client, url, body, stamps):
                errors += 1
                await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, trust_env=False) as client:
        users = [asyncio.create_task(user(client)) for _ in range(concurrency)]
        try:
            await asyncio.sleep(args.phase_s)
            with busy_neighbour(args.core):
                await asyncio.sleep(args.phase_s)
            stopped = time.perf_counter()
            await asyncio.sleep(args.phase_s)
        finally:
            for task in users:
                task.cancel()
            await asyncio.gather(*users, return_exceptions=True)
    return errors, stopped


def episode(args: argparse.Namespace, target: str, root_url: str, concurrency: int, repeat: int) -> Episode:
    result = Episode(target, concurrency, repeat, machine=machine_load())
    before = fallbacks(root_url)
    stamps: list[float] = []
    start = time.perf_counter()
    result.errors, stopped = asyncio.run(closed_loop(args, root_url, concurrency, stamps))
    after = fallbacks(root_url)
    result.fallbacks = after - before if after is not None and before is not None else None
    rate_phases(result, stamps, start + args.warmup_s, stopped, args.phase_s, args.recovered)
    return result


def rate_phases(
    result: Episode, stamps: list[float], counted_from: float, stopped: float, phase_s: float, recovered: float
) -> None:
    """Fills `result`'s rates from the tokens' arrival times: free from `counted_from` to the neighbour's start
    (`stopped - phase_s`), busy until `stopped`, after for `phase_s` more, and per second after."""

    def rate(lo: float, hi: float) -> float:
        return sum(1 for t in stamps if lo <= t < hi) / (hi - lo)

    busy_start = stopped - phase_s
    result.free_tps = rate(counted_from, busy_start)
    result.busy_tps = rate(busy_start, stopped)
    result.after_tps = rate(stopped, stopped + phase_s)
    result.after_per_s = [rate(stopped + s, stopped + s + 1) for s in range(int(phase_s))]
    if result.free_tps:
        result.busy_ratio = result.busy_tps / result.free_tps
        result.after_ratio = result.after_tps / result.free_tps
        bar = recovered * result.free_tps
        per_s = result.after_per_s
        result.recovery_s = next(
            (float(s) for s in range(len(per_s) - 1) if per_s[s] >= bar and per_s[s + 1] >= bar), None
        )


def markdown(episodes: list[Episode]) -> str:
    lines = [
        "| server | conc | rep | free tok/s | neighbour tok/s | ratio | after tok/s | ratio | recovered after | "
        "fallbacks | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in episodes:
        recovery = f"{e.recovery_s:.0f} s" if e.recovery_s is not None else "not within the phase"
        falls = f"{e.fallbacks:.0f}" if e.fallbacks is not None else "-"
        lines.append(
            f"| {e.target} | {e.concurrency} | {e.repeat} | {e.free_tps:.1f} | {e.busy_tps:.1f} | {e.busy_ratio:.2f} "
            f"| {e.after_tps:.1f} | {e.after_ratio:.2f} | {recovery} | {falls} | {' '.join(e.machine['loadavg'])} |"
        )
    return "\n".join(lines)


def target_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not is_loopback(url):
        raise argparse.ArgumentTypeError(f"expected NAME=URL with a loopback URL, got {text!r}")
    return name, url.rstrip("/")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--url", type=target_url, action="append", required=True, help="NAME=URL of a running server; repeatable")
    add("--concurrency", default="1,16", help="comma-separated levels (default: %(default)s)")
    add("--phase-s", type=float, default=20.0, help="seconds of each phase (default: %(default)s)")
    add(
        "--warmup-s", type=float, default=5.0, help="first seconds of the free phase not counted (default: %(default)s)"
    )
    add("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    add("--repeat", type=int, default=1, help="interleaved repetitions (default: %(default)s)")
    add("--core", type=int, default=max(os.sched_getaffinity(0)), help="the neighbour's core (default: %(default)s)")
    add("--recovered", type=float, default=0.8, help="share of the free rate that counts as recovered (default: 0.8)")
    add("--out", type=Path, help="JSON report")
    args = p.parse_args(argv)
    args.concurrency = [int(level) for level in args.concurrency.split(",") if level.strip()]
    if args.warmup_s >= args.phase_s:
        p.error("--warmup-s must be shorter than --phase-s")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    episodes: list[Episode] = []
    for repeat in range(1, args.repeat + 1):
        for concurrency in args.concurrency:
            for name, url in args.url:
                print(f"== {name} at concurrency {concurrency} (repetition {repeat})", file=sys.stderr)
                episodes.append(episode(args, name, url, concurrency, repeat))
                print(markdown(episodes[-1:]), file=sys.stderr)
                time.sleep(2.0)  # the last episode's aborted streams leave the server
    print(markdown(episodes))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {key: value for key, value in vars(args).items() if key != "out"}
        args.out.write_text(json.dumps({"config": config, "episodes": [asdict(e) for e in episodes]}, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
