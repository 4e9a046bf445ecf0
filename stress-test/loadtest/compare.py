"""The comparison mode of the stress test: our server vs `transformers serve` vs a bare `generate()` loop.

Endpoints (`--endpoint`): `completions` and `chat` (text models), `transcription` (Whisper: multipart uploads of
the clips in `--audio-dir`, streamed, so time to first text is the first `transcript.text.delta`; throughput is
seconds of audio transcribed per second of wall time), `image-chat` (a vision-language model: streamed chats that
each carry a JPEG of their own, 160x120 to 640x480 px, as a data URL; `requests_per_s` is image requests per
second), `copy-chat` (greedy chats whose answers copy their prompt: a code file rewritten with one name changed,
a passage quoted; they end where the model ends them, without `ignore_eos`: the workload of speculative decoding,
`copy_chat.py`; compare a server started with `--speculative-config` against one without, `--url` and
`--baseline-url`).

Targets (`--target`, repeatable, or `all`):

* `server`: `python -m transformers_openai.main` started as a subprocess on a free loopback port
  (or an already running one given with `--url`), driven with streaming OpenAI requests that carry
  `ignore_eos: true` so that every request yields exactly `--max-tokens` tokens.
* `transformers-serve`: `transformers serve --continuous-batching` (same `--device` and `--dtype`) with the model
  directory as its forced model. It needs `pip install 'transformers[serving]'` (fastapi, uvicorn,
  openai, ...). It rejects unknown body fields such as `ignore_eos`, so exact lengths are forced via
  its `generation_config` field (`min_new_tokens = max_new_tokens = --max-tokens`). It ignores
  `stream_options` but always sends a final usage chunk, and it ends streams without `[DONE]`. Its
  continuous-batching manager keeps the generation config of the first (warm-up) request.
* `generate-loop`: in-process `model.generate()` (fp32, CPU, sdpa), one prompt (or clip) at a time; for a clip
  over 30 s, transformers' own sequential long-form `generate` on the whole feature sequence.
* `llama-server` (only when named, not in `all`): llama.cpp's server on a GGUF of the same weights (`--gguf`, e.g.
  an F32 or Q8_0 file made by llama.cpp's `convert_hf_to_gguf.py`), started from `--llama-server` (the binary)
  once per concurrency level with `--parallel` slots equal to that level (1,024 tokens of context each) and
  continuous batching on (its default, passed explicitly), `--threads`/`--threads-batch` as `--threads`; or an
  already running one at `--llama-server-url` (its slots as it was started). Text endpoints only. Exact lengths:
  its OpenAI chat and completion endpoints take its own sampling fields too, so requests carry `ignore_eos: true`
  with `max_tokens` as ours do. It closes a keep-alive connection after a few requests, so it is sent every request
  on a connection of its own (a fresh loopback connection costs well under a millisecond).

For image chats, `transformers serve` runs without `--continuous-batching` (it falls back to one request at a time
for image-text-to-text models, LLaVA's for one, and says so in its log), and the `generate` loop is
`AutoModelForImageTextToText.generate` with the model's processor, image decoding included.

For transcription, `transformers serve` runs without `--continuous-batching` (it serves audio one request at a
time either way), non-streaming (it streams raw text, not events), and it drops the audio past 30 s: its figures
count the seconds it was sent, and the report says so.

For every target and concurrency a closed loop keeps `concurrency` requests in flight until
`--requests` have completed. Reported: output tokens/s (all output tokens / batch wall time), TTFT
p50/p99 (send -> first content delta), ITL p50 (gaps between content chunks), E2E p50, errors.
A markdown table goes to stdout and everything to a JSON file (`--out`). Only loopback addresses
are contacted; spawned servers are always killed at the end.

Examples:
    loadtest compare --model .cache/models/smollm2-135m-instruct --target all
    loadtest compare --endpoint transcription --model .cache/models/whisper-tiny-en --target all
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest import copy_chat, image_chat
from loadtest.loadclient import Clip, StreamTimer, load_clips, send_transcription
from loadtest.server import free_port, is_loopback, runs_compiled, served_model, server_command, spawn, wait_compiled

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("server", "transformers-serve", "generate-loop")  # `all`; `baseline` and `llama-server` when asked for
LLAMA_SLOT_TOKENS = 1024  # context per llama-server slot: any prompt of the mix plus --max-tokens
DEFAULT_MODEL = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"
PATHS = {
    "chat": "/v1/chat/completions",
    "copy-chat": "/v1/chat/completions",
    "image-chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "transcription": "/v1/audio/transcriptions",
}
DEFAULT_AUDIO = REPO_ROOT / "tests" / "data" / "audio"

PROMPTS = [
    "Hello!",
    "Tell me a joke.",
    "What is the capital of Japan?",
    "List three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is to a beginner programmer.",
    "Give me a short recipe for pancakes.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarize the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "I am planning a weekend trip to the mountains. What should I pack if the weather may change quickly?",
    "Describe the water cycle. Mention evaporation, condensation and precipitation, and keep it simple.",
    "My houseplant has yellow leaves. I water it twice a week and it sits near a sunny window. What could be wrong?",
    "Translate into plain words: the meeting has been postponed until further notice due to unforeseen circumstances.",
    "Write a polite email to a neighbour asking them to keep the noise down after ten in the evening.",
    "You are a tour guide in an old European city. Welcome a group of tourists and tell them what they will see.",
    "Compare trains and planes for a 500 kilometre journey in cost, time and comfort, then recommend one.",
    "A farmer has chickens and cows with 30 heads and 74 legs in total. How many of each? Explain step by step.",
    "Once upon a time a girl who loved to read found a book with no title in her village library. Continue the story.",
    "What is photosynthesis?",
]


@dataclass
class Result:
    """One request's measurements (seconds)."""

    ok: bool
    e2e: float
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    audio_s: float = 0.0  # seconds of audio transcribed (transcription only)


@dataclass
class Row:
    """One line of the report."""

    target: str
    concurrency: int
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    wall_s: float | None = None
    requests_per_s: float | None = None
    output_tok_s: float | None = None
    audio_s_per_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None  # a burst's last first token: the level's slowest time to first token
    itl_p50_ms: float | None = None
    e2e_p50_s: float | None = None
    note: str = ""
    repeat: int = 1  # the interleaved repetition it belongs to


def pct(values: list[float], q: float, scale: float = 1.0) -> float | None:
    return round(float(np.percentile(values, q)) * scale, 3) if values else None


def summarize(target: str, conc: int, results: list[Result], wall: float, note: str = "") -> Row:
    good = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in good)
    errors = [r.error for r in results if not r.ok]
    if errors:
        note = "; ".join(filter(None, (note, f"first error: {errors[0]}")))[:200]
    ttfts, itls = [r.ttft for r in good if r.ttft is not None], [g for r in good for g in r.itls]
    tok_s = round(tokens / wall, 2) if wall > 0 and tokens else None
    per_s = round(len(good) / wall, 2) if wall > 0 and good else None
    audio = sum(r.audio_s for r in good)
    audio_rate = round(audio / wall, 2) if wall > 0 and audio else None
    ttft, e2e = (pct(ttfts, 50, 1e3), pct(ttfts, 99, 1e3), pct(ttfts, 100, 1e3)), pct([r.e2e for r in good], 50)
    return Row(
        target,
        conc,
        len(results),
        len(errors),
        tokens,
        round(wall, 3),
        per_s,
        tok_s,
        audio_rate,
        *ttft,
        pct(itls, 50, 1e3),
        e2e,
        note,
    )


def pick_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [PROMPTS[rng.randrange(len(PROMPTS))] for _ in range(n)]


def inputs(args: argparse.Namespace, n: int, seed: int) -> list[Any]:
    """The prompts, or for transcription the clips, or for image chats the questions and pictures, of one level."""
    if args.endpoint == "image-chat":
        return image_chat.pick(n, seed)
    if args.endpoint == "copy-chat":
        return copy_chat.pick(n, seed)
    return pick_clips(args.clips, n, seed) if args.endpoint == "transcription" else pick_prompts(n, seed)


def n_requests(args: argparse.Namespace, conc: int) -> int:
    return args.requests if args.requests else max(2 * conc, 8)


def check_loopback(url: str) -> str:
    if not is_loopback(url):
        raise SystemExit(f"refusing non-loopback URL {url!r}: only loopback addresses are allowed")
    return url.rstrip("/")


# ----------------------------------------------------------------------------- HTTP client


def request_body(args: argparse.Namespace, target: str, model: str, prompt: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint in ("chat", "copy-chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
    elif args.endpoint == "image-chat":
        body["messages"] = image_chat.messages(prompt)
    else:
        body["prompt"] = prompt
    if target == "transformers-serve":
        n = args.max_tokens
        body["generation_config"] = json.dumps({"max_new_tokens": n, "min_new_tokens": n, "do_sample": False})
    elif args.endpoint != "copy-chat":  # copied answers end where the model ends them
        body["ignore_eos"] = True
    return body


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> Result:
    """Send one streaming request; time the content-bearing SSE chunks (the stress test's own parser)."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                return Result(False, time.perf_counter() - start, error=f"HTTP {resp.status_code}: {detail}")
            timer = StreamTimer(start, chat)
            async for line in resp.aiter_lines():
                if not timer.feed(line):
                    break
    except Exception as exc:  # noqa: BLE001 - any failure is one errored request
        return Result(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:200])
    record = timer.record(time.perf_counter())
    if not record.ok:
        return Result(False, record.e2e_s, error=f"{record.status}: {record.detail}")
    return Result(True, record.e2e_s, record.output_tokens, record.ttft_s, record.itl_s)


def pick_clips(clips: tuple[Clip, ...], n: int, seed: int) -> list[Clip]:
    """Every clip in turn, shuffled: each level sends the same mix of lengths."""
    order = [clips[i % len(clips)] for i in range(n)]
    random.Random(seed).shuffle(order)
    return order


async def transcribe_one(
    client: httpx.AsyncClient, url: str, clip: Clip, model: str, stream: bool, sent_s: float
) -> Result:
    """One transcription (the load tool's own request); `sent_s`: the seconds of audio the target transcribes."""
    try:
        record = await send_transcription(client, url, clip, model, stream)
    except Exception as exc:  # noqa: BLE001 - any failure is one errored request
        return Result(False, 0.0, error=f"{type(exc).__name__}: {exc}"[:200])
    if not record.ok:
        return Result(False, record.e2e_s, error=f"{record.status}: {record.detail}")
    return Result(True, record.e2e_s, 0, record.ttft_s, [], audio_s=sent_s)


async def closed_loop(
    args: argparse.Namespace, target: str, base: str, model: str, prompts: list[Any], conc: int, budget: float
) -> tuple[list[Result], float]:
    """Keep `conc` requests in flight until all prompts (or clips) are done; returns results and wall time."""
    chat = args.endpoint in ("chat", "image-chat", "copy-chat")
    url = base + PATHS[args.endpoint]
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    keep = 0 if target == "llama-server" else conc + 4  # it closes kept connections: one per request
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=keep)
    results: list[Result] = []
    todo = iter(prompts)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def one(prompt: Any) -> Result:
            if args.endpoint == "transcription":
                # transformers serve streams raw text and keeps only the first 30 s
                ours = target in ("server", "baseline")
                sent = prompt.seconds if ours else min(prompt.seconds, 30.0)
                coro = transcribe_one(client, url, prompt, model, ours, sent)
            else:
                coro = stream_one(client, url, request_body(args, target, model, prompt), chat)
            try:
                return await asyncio.wait_for(coro, args.request_timeout)
            except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError only from Python 3.11
                return Result(False, args.request_timeout, error="request timeout")

        async def worker() -> None:
            for prompt in todo:
                results.append(await one(prompt))

        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(conc))), max(budget, 1.0))
        except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError only from Python 3.11
            done = len(results)
            results.extend(Result(False, 0.0, error="run time limit") for _ in range(len(prompts) - done))
        return results, time.perf_counter() - start


# ----------------------------------------------------------------------------- subprocess servers


def target_command(args: argparse.Namespace, target: str, port: int, slots: int = 1) -> list[str]:
    model, listen = str(args.model), ["--host", "127.0.0.1", "--port", str(port)]
    if target == "llama-server":
        threads = ["--threads", str(args.threads), "--threads-batch", str(args.threads)]
        context = ["--parallel", str(slots), "--ctx-size", str(slots * LLAMA_SLOT_TOKENS), "--cont-batching"]
        alias = ["--alias", args.model_name or args.model.name]
        return [str(args.llama_server), "-m", str(args.gguf), *listen, *threads, *context, *alias, *args.llama_arg]
    if target == "server":
        opts = f"--max-batch-size {args.max_batch_size}" if args.max_batch_size else ""
        opts += f" --dtype {args.dtype} --device {args.device}"
        return server_command(model, port, *opts.split(), *args.server_arg, torch_threads=args.threads)
    # transformers' own CLI entry point, run by this interpreter (its `transformers` script may not be on PATH)
    exe = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]
    flags = ["--device", args.device, "--dtype", args.dtype, "--log-level", "warning"]
    if args.endpoint not in ("transcription", "image-chat"):
        flags.insert(0, "--continuous-batching")
    return [*exe, "serve", *flags, *listen, model]


def bench_http(args: argparse.Namespace, target: str, deadline: float, log: Path) -> list[Row]:
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1")
    if target == "transformers-serve":
        missing = [name for name in ("fastapi", "uvicorn", "openai") if find_spec(name) is None]
        if missing:
            return [Row(target, 0, note=f"unavailable: missing {missing}; pip install 'transformers[serving]'")]
    if target == "llama-server":
        return bench_llama_server(args, deadline, log, env)
    try:
        if target == "server" and args.url:
            return run_levels(args, target, args.url, deadline)
        if target == "baseline":
            return run_levels(args, target, args.baseline_url, deadline)
        port = free_port()
        command = target_command(args, target, port)
        with spawn(command, port, log, env=env, cwd=REPO_ROOT, timeout_s=args.startup_timeout) as server:
            return run_levels(args, target, server.root_url, deadline)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - report, don't crash the other targets
        return [Row(target, 0, note=f"unavailable: {type(exc).__name__}: {exc}"[:400])]


def bench_llama_server(args: argparse.Namespace, deadline: float, log: Path, env: dict[str, str]) -> list[Row]:
    """llama-server at each level: one started with as many slots as the level's concurrency (or the running one at
    `--llama-server-url` for all levels)."""
    if args.llama_server_url:
        try:
            return run_levels(args, "llama-server", args.llama_server_url, deadline)
        except Exception as exc:  # noqa: BLE001 - report, don't crash the other targets
            return [Row("llama-server", 0, note=f"unavailable: {type(exc).__name__}: {exc}"[:400])]
    rows = []
    for conc in args.concurrency:
        level = argparse.Namespace(**{**vars(args), "concurrency": [conc]})
        port = free_port()
        command = target_command(args, "llama-server", port, slots=conc)
        try:
            with spawn(command, port, log, env=env, cwd=REPO_ROOT, timeout_s=args.startup_timeout) as server:
                rows += run_levels(level, "llama-server", server.root_url, deadline)
        except Exception as exc:  # noqa: BLE001 - report, don't crash the other levels
            rows.append(Row("llama-server", conc, note=f"unavailable: {type(exc).__name__}: {exc}"[:400]))
    return rows


def run_levels(args: argparse.Namespace, target: str, base: str, deadline: float) -> list[Row]:
    model = args.model_name or (args.model.name if target == "llama-server" else str(args.model))
    if target in ("server", "baseline") and not args.model_name:
        model = served_model(base, model)
    if target in ("server", "baseline"):  # measure the decode step it keeps, not eager steps beside a compiler
        wait_compiled(base, args.wait_compiled_s)
    # One burst at the highest concurrency first: a freshly started process is slower until its allocator and
    # caches reach their working size (seen: 20-35% longer decode steps than a long-running one in its first waves).
    width = max(args.concurrency)
    warm_up = inputs(args, width, args.seed + 1)
    warm, _ = asyncio.run(closed_loop(args, target, base, model, warm_up, width, deadline - time.monotonic()))
    if not any(r.ok for r in warm):
        raise RuntimeError(f"warm-up failed: {warm[0].error}")
    step = "compiled decode step" if target in ("server", "baseline") and runs_compiled(base) else ""
    rows = []
    for conc in args.concurrency:
        left = deadline - time.monotonic()
        if left <= 0:
            rows.append(Row(target, conc, note="skipped: run time limit"))
            continue
        prompts = inputs(args, n_requests(args, conc), args.seed)
        results, wall = asyncio.run(closed_loop(args, target, base, model, prompts, conc, left))
        rows.append(summarize(target, conc, results, wall, step))
        row = rows[-1]
        rate = f"{row.output_tok_s} tok/s"
        if args.endpoint == "transcription":
            rate = f"{row.audio_s_per_s} audio s/s"
        elif args.endpoint == "image-chat":
            rate = f"{row.requests_per_s} image requests/s, TTFT p50 {row.ttft_p50_ms} ms"
        print(f"  {target} c={conc}: {rate}, errors={rows[-1].errors}", file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------- generate() loop


def bench_generate(args: argparse.Namespace, deadline: float) -> list[Row]:
    if args.endpoint == "transcription":
        return bench_generate_speech(args, deadline)
    if args.endpoint == "image-chat":
        return bench_generate_images(args, deadline)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model: Any = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa", device_map=args.device
    )
    model.eval()
    n = args.max_tokens

    def encode(prompt: str) -> Any:
        if args.endpoint in ("chat", "copy-chat"):
            return tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        return tok(prompt, return_tensors="pt")

    def run(prompt: str) -> Result:
        inputs = encode(prompt).to(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        return Result(True, time.perf_counter() - start, out.shape[-1] - inputs["input_ids"].shape[-1])

    run(PROMPTS[0])  # warm-up
    results: list[Result] = []
    note = "sequential"
    start = time.perf_counter()
    for prompt in pick_prompts(n_requests(args, 1), args.seed):
        if time.monotonic() > deadline:
            note = "sequential; stopped by run time limit"
            break
        results.append(run(prompt))
    wall = time.perf_counter() - start
    return [summarize("generate-loop", 1, results, wall, note)]


def bench_generate_images(args: argparse.Namespace, deadline: float) -> list[Row]:
    """A vision-language model's `generate` on one image chat at a time."""
    run = image_chat.generate_loop(str(args.model), args.threads, args.max_tokens)
    run(image_chat.pick(1, args.seed + 1)[0])  # warm-up
    results: list[Result] = []
    note = "sequential"
    start = time.perf_counter()
    for item in image_chat.pick(n_requests(args, 1), args.seed):
        if time.monotonic() > deadline:
            note = "sequential; stopped by run time limit"
            break
        seconds, tokens = run(item)
        results.append(Result(True, seconds, tokens))
    return [summarize("generate-loop", 1, results, time.perf_counter() - start, note)]


def bench_generate_speech(args: argparse.Namespace, deadline: float) -> list[Row]:
    """Whisper's `generate` on one clip at a time: one window, or transformers' sequential long-form."""
    import librosa
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.set_num_threads(args.threads)
    model: Any = WhisperForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32).eval()
    features = WhisperFeatureExtractor.from_pretrained(args.model)

    def run(clip: Clip) -> Result:
        start = time.perf_counter()
        audio, _ = librosa.load(io.BytesIO(clip.data), sr=16000, mono=True)
        long_form = audio.size > 30 * 16000
        extra: dict[str, Any] = (
            {"truncation": False, "padding": "longest", "return_attention_mask": True} if long_form else {}
        )
        inputs = features(audio, sampling_rate=16000, return_tensors="pt", **extra)
        with torch.inference_mode():
            model.generate(inputs.input_features, attention_mask=inputs.get("attention_mask"), return_timestamps=True)
        end = time.perf_counter()
        return Result(True, end - start, 0, end - start, [], audio_s=clip.seconds)

    run(args.clips[0])  # warm-up
    results: list[Result] = []
    note = "sequential"
    start = time.perf_counter()
    for clip in pick_clips(args.clips, n_requests(args, 1), args.seed):
        if time.monotonic() > deadline:
            note = "sequential; stopped by run time limit"
            break
        results.append(run(clip))
    return [summarize("generate-loop", 1, results, time.perf_counter() - start, note)]


# ----------------------------------------------------------------------------- report


def markdown(rows: list[Row]) -> str:
    cols = [f.name for f in fields(Row) if f.name not in ("output_tokens", "wall_s")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        values = asdict(row)
        lines.append("| " + " | ".join("-" if values[c] is None else str(values[c]) for c in cols) + " |")
    return "\n".join(lines)


def ratios(rows: list[Row], concurrency: list[int]) -> dict[str, float]:
    """The ratios one repetition's rows allow: each server's scaling from the lowest to the highest concurrency and
    against the `generate` loop, and ours against each other target (throughput, and a burst's last first token)."""

    def row(target: str, conc: int) -> Row | None:
        return next((r for r in rows if r.target == target and r.concurrency == conc), None)

    def tps(target: str, conc: int) -> float | None:
        found = row(target, conc)
        return None if found is None else found.output_tok_s or found.audio_s_per_s

    def ttft_max(target: str) -> float | None:
        found = row(target, hi)
        return None if found is None else found.ttft_max_ms

    lo, hi = min(concurrency), max(concurrency)
    base = tps("generate-loop", 1)
    out: dict[str, float] = {}

    def put(name: str, a: float | None, b: float | None) -> None:
        if a and b:
            out[name] = round(a / b, 2)

    for target in ("server", "transformers-serve", "baseline"):
        if hi != lo:
            put(f"{target} c{hi} / {target} c{lo}", tps(target, hi), tps(target, lo))
        put(f"{target} c{hi} / generate-loop", tps(target, hi), base)
    for peer in ("transformers-serve", "baseline"):
        put(f"server c{hi} / {peer} c{hi}", tps("server", hi), tps(peer, hi))
        put(f"server c{hi} slowest first token / {peer}'s", ttft_max("server"), ttft_max(peer))
    for conc in concurrency:  # llama-server at every level: throughput, and the median first token
        ours, theirs = row("server", conc), row("llama-server", conc)
        put(f"server c{conc} / llama-server c{conc}", tps("server", conc), tps("llama-server", conc))
        if ours is not None and theirs is not None:
            put(f"server c{conc} TTFT p50 / llama-server's", ours.ttft_p50_ms, theirs.ttft_p50_ms)
    return out


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", type=Path, default=DEFAULT_MODEL, help="local HF model directory (default: %(default)s)")
    add(
        "--target",
        action="append",
        choices=[*TARGETS, "baseline", "llama-server", "all"],
        help="what to run; repeatable (default: all)",
    )
    add(
        "--baseline-url",
        help="target `baseline`: an already running server at this loopback URL (e.g. an older "
        "checkout of ours), benchmarked like `server` and interleaved with the other targets",
    )
    add("--url", help="benchmark an already running `server` at this loopback base URL instead of spawning one")
    add("--llama-server", type=Path, help="target `llama-server`: llama.cpp's server binary, started per level")
    add("--gguf", type=Path, help="target `llama-server`: the GGUF file it serves (the same weights as --model)")
    add("--llama-server-url", help="target `llama-server`: an already running one at this loopback URL instead")
    add("--llama-arg", action="append", default=[], help="extra argument for a started llama-server; repeatable")
    add("--model-name", help="`model` field to send (default: first id of GET /v1/models, else --model)")
    add(
        "--endpoint",
        choices=["completions", "chat", "copy-chat", "transcription", "image-chat"],
        default="completions",
        help="(default: %(default)s)",
    )
    add("--audio-dir", type=Path, default=DEFAULT_AUDIO, help="clips for transcription (default: %(default)s)")
    add("--concurrency", type=int_list, default="1,4,16", help="comma-separated levels (default: %(default)s)")
    add("--requests", type=int, default=0, help="requests per level (default: max(2*concurrency, 8))")
    add("--max-tokens", type=int, default=64, help="exact output tokens per request (default: %(default)s)")
    add("--max-batch-size", type=int, default=0, help="for our server (default 0: the server's own default)")
    add("--device", choices=["cpu", "cuda"], default="cpu", help="where every target runs (default: %(default)s)")
    add(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="every target's weights (default: %(default)s)",
    )
    add("--repeat", type=int, default=1, help="interleaved repetitions: all targets, then all again (default: 1)")
    add("--threads", type=int, default=1, help="torch/OMP threads of each model process (default: %(default)s)")
    add("--seed", type=int, default=0, help="prompt selection seed (default: %(default)s)")
    add("--request-timeout", type=float, default=300.0, help="seconds per request (default: %(default)s)")
    add("--startup-timeout", type=float, default=180.0, help="seconds to wait for /health (default: %(default)s)")
    add(
        "--wait-compiled-s",
        type=float,
        default=1800.0,
        help="our server: wait at most this long while it compiles its decode step in the background, before any "
        "request (default: %(default)s)",
    )
    add("--time-limit", type=float, default=3600.0, help="seconds for the whole run (default: %(default)s)")
    add("--server-arg", action="append", default=[], help="extra argument for our server; repeatable")
    add("--out", type=Path, help="JSON report (default: results/compare-<timestamp>.json, logs beside it)")
    args = p.parse_args(argv)
    targets = args.target or ["all"]
    args.target = list(TARGETS) if "all" in targets else list(dict.fromkeys(targets))
    args.url = check_loopback(args.url) if args.url else None
    args.baseline_url = check_loopback(args.baseline_url) if args.baseline_url else None
    if "baseline" in args.target and not args.baseline_url:
        p.error("--target baseline needs --baseline-url")
    args.llama_server_url = check_loopback(args.llama_server_url) if args.llama_server_url else None
    if "llama-server" in args.target:
        if args.endpoint not in ("chat", "completions"):
            p.error("--target llama-server serves the text endpoints only (chat, completions)")
        if not args.llama_server_url and not (args.llama_server and args.gguf):
            p.error("--target llama-server needs --llama-server and --gguf, or --llama-server-url")
        for path in () if args.llama_server_url else (args.llama_server, args.gguf):
            if not path.is_file():
                p.error(f"--target llama-server: {path} is not a file")
    args.model = args.model.resolve()  # spawned servers run from the repository root
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = args.out or Path("results") / f"compare-{stamp}.json"
    args.clips = load_clips(args.audio_dir) if args.endpoint == "transcription" else []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for rep in range(1, args.repeat + 1):
        for target in args.target:
            print(f"== {target} (repetition {rep})", file=sys.stderr)
            if time.monotonic() > deadline:
                new = [Row(target, 0, note="skipped: run time limit")]
            elif target == "generate-loop":
                new = bench_generate(args, deadline)
            else:
                new = bench_http(args, target, deadline, args.out.with_suffix(f".{target}.{rep}.log"))
            for row in new:
                row.repeat = rep
            rows.extend(new)
    ratio: dict[str, float] = {}
    for rep in range(1, args.repeat + 1):
        suffix = f" (repetition {rep})" if args.repeat > 1 else ""
        mine = [row for row in rows if row.repeat == rep]
        ratio |= {name + suffix: value for name, value in ratios(mine, args.concurrency).items()}
    print(markdown(rows))
    print()
    for name, value in ratio.items():
        print(f"- {name}: {value}")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "clips"}
    config["clips"] = [{"name": clip.name, "seconds": round(clip.seconds, 2)} for clip in args.clips]
    versions = {pkg: version(pkg) for pkg in ("torch", "transformers", "httpx")} | {"python": sys.version.split()[0]}
    report = {"config": config, "versions": versions, "results": [asdict(r) for r in rows], "ratios": ratio}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
