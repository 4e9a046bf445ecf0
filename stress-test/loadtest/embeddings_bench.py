"""Embeddings per second: our server at concurrency 1 and 16 against sentence-transformers' `encode` in process.

One text per request (closed loop, the load generator's `embeddings` workload: texts of a few words to ~150), so
at concurrency 16 the server's own batching across requests is what is measured. The baseline is
`SentenceTransformer.encode` on the same texts in this process: batched (`--batch-size`, all texts in one call)
and one text per call (what a single user gets without a server). The targets are interleaved, round after
round, with the same torch threads; the server is started once (the load generator's way) and idles while the
baseline runs.

    loadtest embeddings --model .cache/models/all-minilm-l6-v2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.loadclient import EMBEDDING_TEXTS, RequestSpec, pick_prompt
from loadtest.loadlevels import LevelRun, closed_loop
from loadtest.loadstats import summarize_level
from loadtest.server import ServerOptions, local_server, machine_info

ROOT = Path(__file__).resolve().parents[2]


def texts(count: int) -> list[str]:
    """The texts the load generator sends, in its order."""
    return [pick_prompt(i, EMBEDDING_TEXTS) for i in range(count)]


async def server_level(base_url: str, concurrency: int, requests: int) -> dict[str, Any]:
    spec = RequestSpec("embeddings", "bench", max_tokens=0)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        run = LevelRun(client, base_url, spec, 300.0, stop_issuing_at=math.inf, max_requests=requests)
        await closed_loop(run, concurrency, backoff_cap_s=1.0)
    level = summarize_level("concurrency", concurrency, run.records)
    if level["failed"]:
        raise RuntimeError(f"{level['failed']} requests failed: {level['first_error']}")
    return {"embeddings_per_s": level["output_tokens_per_s"], "e2e_ms": level["e2e_ms"]}


def encode_rate(model: Any, inputs: list[str], batch_size: int) -> float:
    started = time.perf_counter()
    if batch_size == 1:
        for text in inputs:
            model.encode([text], batch_size=1)
    else:
        model.encode(inputs, batch_size=batch_size)
    return len(inputs) / (time.perf_counter() - started)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    baseline = SentenceTransformer(str(args.model), device="cpu")
    options = ServerOptions(
        model=args.model,
        log_path=args.log,
        torch_threads=args.threads,
        extra_args=[
            "--served-model-name",
            "bench",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-batch-size",
            str(args.batch_size),
        ],
    )
    rounds: list[dict[str, float]] = []
    with local_server(options) as base_url:
        asyncio.run(server_level(base_url, 4, 16))  # warm-up
        encode_rate(baseline, texts(16), args.batch_size)
        for number in range(1, args.rounds + 1):
            row = {
                "server_c1": asyncio.run(server_level(base_url, 1, args.requests_c1))["embeddings_per_s"],
                "server_c16": asyncio.run(server_level(base_url, 16, args.requests_c16))["embeddings_per_s"],
                "st_encode_batched": encode_rate(baseline, texts(args.requests_c16), args.batch_size),
                "st_encode_one_by_one": encode_rate(baseline, texts(args.requests_c1), 1),
            }
            rounds.append({key: round(value, 1) for key, value in row.items()})
            print(f"round {number}: {rounds[-1]}", flush=True)
    medians = {key: round(statistics.median(r[key] for r in rounds), 1) for key in rounds[0]}
    return {
        "schema": "transformers-openai-api/embeddings-bench/1",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": _shown(args.model),
        "config": {key: _shown(value) for key, value in vars(args).items()},
        "machine": machine_info(spawned=True, torch_threads=args.threads),
        "sentence_transformers": _version("sentence-transformers"),
        "rounds": rounds,
        "median": medians,
        "ratios": {
            "server_c16_over_st_batched": round(medians["server_c16"] / medians["st_encode_batched"], 2),
            "server_c1_over_st_one_by_one": round(medians["server_c1"] / medians["st_encode_one_by_one"], 2),
        },
    }


def _shown(value: object) -> str:
    """A path inside the repository as a relative one (results files do not name the machine's folders)."""
    if isinstance(value, Path) and value.resolve().is_relative_to(ROOT):
        return str(value.resolve().relative_to(ROOT))
    return str(value)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "all-minilm-l6-v2")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both sides")
    parser.add_argument("--batch-size", type=int, default=32, help="encode's batch and the server's rows")
    parser.add_argument("--requests-c1", type=int, default=96, help="requests at concurrency 1 (one text each)")
    parser.add_argument("--requests-c16", type=int, default=384, help="requests at concurrency 16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results") / "embeddings-minilm-cpu.json")
    parser.add_argument("--log", type=Path, default=Path("/tmp/embeddings_bench_server.log"))
    args = parser.parse_args(argv)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"median": report["median"], "ratios": report["ratios"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
