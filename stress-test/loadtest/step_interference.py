"""What other work costs an engine step: the decode step measured in process alone; beside a second OpenMP team (a
pooled thread of the same process that once ran a parallel torch op and lives on, as the server's model loader did
until it moved to a thread that ends); beside a thread that holds the GIL in short bursts (as the event loop does
when it streams a step's tokens); and beside streaming HTTP in other processes (a uvicorn + sse-starlette server
sending `batch` streams at the step's rate to an httpx client, as the API front would if the engine ran in a process
of its own).

Each condition runs `loadtest step-breakdown`'s measurement (the mean total of the steps that decode the full
batch), conditions interleaved batch by batch, `--repeat` times.

Example:
    loadtest step-interference --batch 1,16 --threads 2 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest.server import free_port
from loadtest.step_breakdown import breakdown

REPO_ROOT = Path(__file__).resolve().parents[2]

CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " word"}}]}


def serve_sse(port: int, gap_s: float, chunks: int) -> None:
    """A server whose every POST streams `chunks` chat chunks, one per `gap_s`, as our server streams tokens."""
    import uvicorn
    from fastapi import FastAPI
    from sse_starlette.sse import EventSourceResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> EventSourceResponse:
        async def events() -> Any:
            for _ in range(chunks):
                await asyncio.sleep(gap_s)
                yield json.dumps(CHUNK)
            yield "[DONE]"

        return EventSourceResponse(events())

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def read_sse(port: int, streams: int) -> None:
    """Keeps `streams` streams of `serve_sse` open, reading every line, until killed."""
    import httpx

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={}) as response:
            async for _ in response.aiter_lines():
                pass

    async def forever() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while True:
                await asyncio.gather(*(one(client) for _ in range(streams)))

    asyncio.run(forever())


@contextmanager
def second_openmp_team() -> Iterator[None]:
    """A pooled thread that has run one parallel torch op, alive (with its OpenMP team) for the duration."""
    import torch

    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: torch.ones(4_000_000).mul(2)).result()
        yield


@contextmanager
def gil_bursts(burst_ms: float, every_ms: float) -> Iterator[None]:
    """A thread of this process running `burst_ms` of Python (holding the GIL) every `every_ms`."""
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            while time.perf_counter() - start < burst_ms / 1e3:
                pass
            stop.wait(every_ms / 1e3)

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def http_elsewhere(streams: int, gap_s: float) -> Iterator[None]:
    """`streams` SSE streams, a chunk per `gap_s` each, between two other processes."""
    port = free_port()
    me = [sys.executable, "-m", "loadtest.step_interference"]
    server = subprocess.Popen([*me, "--serve-sse", str(port), "--gap", str(gap_s)])
    client = None
    try:
        time.sleep(3)  # the server up
        client = subprocess.Popen([*me, "--read-sse", str(port), "--streams", str(streams)])
        time.sleep(2)  # the streams open
        yield
    finally:
        for process in (client, server):
            if process is not None:
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--burst-ms", type=float, default=0.3, help="GIL held per burst (default: %(default)s)")
    parser.add_argument("--burst-every-ms", type=float, default=5.0, help="(default: %(default)s)")
    parser.add_argument("--out", type=Path, help="JSON of every measurement")
    parser.add_argument("--serve-sse", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--read-sse", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gap", type=float, default=0.05, help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_sse:
        serve_sse(args.serve_sse, args.gap, args.max_tokens)
        return 0
    if args.read_sse:
        read_sse(args.read_sse, args.streams)
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_openai.runners.packed_linear import pack_linear_layers

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pack_linear_layers(model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    gil = f"GIL held {args.burst_ms} ms every {args.burst_every_ms} ms"
    conditions = ("alone", "beside a second OpenMP team", gil, "HTTP streams in other processes")
    ms: dict[tuple[int, str], list[float]] = {}

    def step_ms(batch: int, condition: str) -> float:
        total = breakdown(model, tokenizer, batch, args.max_tokens)["total"]
        ms.setdefault((batch, condition), []).append(total)
        return total

    for _ in range(args.repeat):
        for batch in (int(b) for b in args.batch.split(",")):
            alone = step_ms(batch, conditions[0])
            with second_openmp_team():
                step_ms(batch, conditions[1])
            with gil_bursts(args.burst_ms, args.burst_every_ms):
                step_ms(batch, conditions[2])
            with http_elsewhere(batch, alone / 1e3):
                step_ms(batch, conditions[3])
    print(f"{args.model.name}, float32, {args.threads} thread(s): mean decode step ms (each repetition)\n")
    print("| batch | " + " | ".join(conditions) + " |\n|---|" + "---|" * len(conditions))
    for batch in dict.fromkeys(b for b, _ in ms):
        base = statistics.median(ms[batch, conditions[0]])
        cells = [
            " / ".join(f"{v:.1f}" for v in ms[batch, c])
            + ("" if c == conditions[0] else f" ({statistics.median(ms[batch, c]) / base:.2f}x)")
            for c in conditions
        ]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    if args.out:
        rows = [{"batch": b, "condition": c, "step_ms": v} for (b, c), v in ms.items()]
        args.out.write_text(json.dumps({"threads": args.threads, "model": args.model.name, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
