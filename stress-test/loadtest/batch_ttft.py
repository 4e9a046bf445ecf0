"""Interactive time to first token with a Batch API batch running on the same server, against none running.

Starts our server (or uses `--url`), then for each concurrency level (1-4 by default) alternates two phases, round
after round, so the machine's drift hits both alike: "idle" (no batch) and "batch" (a `--batch-lines`-line chat
batch submitted through /v1/files and /v1/batches and running: the phase starts once its first line is answered,
and the batch is cancelled at the phase's end). In each phase `concurrency` clients send `--requests` streamed chat
requests each, one after another, timed by loadtest's client (send -> first chunk with text). The report has the
median TTFT per level and phase and their ratio.

Example:
    loadtest batch-ttft --model .cache/models/smollm2-135m-instruct --rounds 2 --out batch-ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from loadtest.loadclient import RequestSpec, pick_prompt, send
from loadtest.server import ServerOptions, local_server, runs_compiled, served_model, wait_compiled

REPO_ROOT = Path(__file__).resolve().parents[2]
FINAL = ("completed", "failed", "cancelled", "expired")


def batch_file(model: str, lines: int, max_tokens: int) -> bytes:
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": pick_prompt(i)}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
        }
        for i in range(lines)
    ]
    return "\n".join(json.dumps(row) for row in rows).encode()


async def start_batch(client: httpx.AsyncClient, base: str, data: bytes) -> str:
    """Uploads the input and creates the batch; returns once its first line is answered (it is running)."""
    files = {"file": ("ttft.jsonl", data)}
    file = (await client.post(f"{base}/files", files=files, data={"purpose": "batch"})).raise_for_status().json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = (await client.post(f"{base}/batches", json=body)).raise_for_status().json()
    while True:
        state = (await client.get(f"{base}/batches/{batch['id']}")).json()
        if state["request_counts"]["completed"] >= 1 or state["status"] in FINAL:
            return str(batch["id"])
        await asyncio.sleep(0.1)


async def stop_batch(client: httpx.AsyncClient, base: str, batch_id: str) -> dict[str, Any]:
    await client.post(f"{base}/batches/{batch_id}/cancel")
    while True:
        state: dict[str, Any] = (await client.get(f"{base}/batches/{batch_id}")).json()
        if state["status"] in FINAL:
            return state
        await asyncio.sleep(0.1)


async def ttfts(
    client: httpx.AsyncClient, root: str, spec: RequestSpec, concurrency: int, requests: int
) -> list[float]:
    """`concurrency` clients, each sending `requests` streamed requests in turn: their TTFTs in milliseconds."""

    async def one_client(index: int) -> list[float]:
        times = []
        for k in range(requests):
            record = await send(client, root, spec, pick_prompt(index * requests + k), timeout_s=300)
            if not record.ok or record.ttft_s is None:
                raise RuntimeError(f"request failed: {record.status} {record.detail}")
            times.append(record.ttft_s * 1000)
        return times

    per_client = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    return [t for times in per_client for t in times]


async def measure(args: argparse.Namespace, root_url: str) -> dict[str, Any]:
    root = root_url.rstrip("/")
    base = root + "/v1"
    model = served_model(base, str(args.model))
    spec = RequestSpec("chat-stream", model, args.max_tokens)
    data = batch_file(model, args.batch_lines, args.batch_max_tokens)
    samples: dict[int, dict[str, list[float]]] = {c: {"idle": [], "batch": []} for c in args.concurrency}
    answered = 0
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        await asyncio.to_thread(wait_compiled, root, args.wait_compiled_s)
        await ttfts(client, root, spec, 1, 2)  # warm-up
        compiled = runs_compiled(root)
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                samples[concurrency]["idle"] += await ttfts(client, root, spec, concurrency, args.requests)
                batch_id = await start_batch(client, base, data)
                samples[concurrency]["batch"] += await ttfts(client, root, spec, concurrency, args.requests)
                answered += (await stop_batch(client, base, batch_id))["request_counts"]["completed"]
    levels = {}
    for concurrency, phases in samples.items():
        idle, busy = statistics.median(phases["idle"]), statistics.median(phases["batch"])
        levels[str(concurrency)] = {
            "ttft_p50_ms": {"idle": round(idle, 1), "batch": round(busy, 1)},
            "ratio": round(busy / idle, 2),
            "samples": len(phases["idle"]),
        }
    return {
        "model": model,
        "batch_lines": args.batch_lines,
        "batch_max_tokens": args.batch_max_tokens,
        "batch_concurrency": args.batch_concurrency,
        "max_tokens": args.max_tokens,
        "batch_lines_answered_while_measuring": answered,
        "decode_step_compiled": compiled,
        "levels": levels,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct")
    p.add_argument("--url", help="an already running server (its root URL) instead of starting one")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 3, 4], help="(default: %(default)s)")
    p.add_argument("--requests", type=int, default=4, help="requests per client and phase (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per interactive request (default: %(default)s)")
    p.add_argument("--batch-lines", type=int, default=200, help="(default: %(default)s)")
    p.add_argument("--batch-max-tokens", type=int, default=64, help="tokens per batch line (default: %(default)s)")
    p.add_argument("--batch-concurrency", type=int, default=4, help="the server's flag (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    p.add_argument("--server-arg", action="append", default=[], help="another server flag (repeatable)")
    p.add_argument(
        "--wait-compiled-s",
        type=float,
        default=1800,
        help="wait at most this long while the server compiles its decode step (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with ExitStack() as stack:
        url = args.url
        if url is None:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="batch-ttft-"))
            extra = ["--data-dir", data_dir, "--batch-concurrency", str(args.batch_concurrency), *args.server_arg]
            log = Path(data_dir) / "server.log"
            opts = ServerOptions(args.model, log, torch_threads=args.threads, extra_args=extra)
            url = stack.enter_context(local_server(opts))
        report = asyncio.run(measure(args, url))
    report["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
