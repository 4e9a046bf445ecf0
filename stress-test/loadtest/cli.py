"""The one CLI of the load tests: `loadtest SUBCOMMAND [its options]`; each subcommand is one tool's `main`."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, what it does); each module's `main(argv)` parses its own options (`--help`).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("loadgen", "load sweep over concurrency or arrival rate against our server (spawned) or a URL"),
    "compare": ("compare", "our server vs `transformers serve` vs a generate loop (or a baseline URL), interleaved"),
    "plot": ("plot", "PNG graphs from `run` summaries"),
    "embeddings": ("embeddings_bench", "embeddings/s: our server against sentence-transformers' encode"),
    "kv-memory": ("kv_memory", "peak memory of one long prompt among short ones (in process)"),
    "prefix-ttft": ("prefix_ttft", "time to first token over a cached prefix (in process)"),
    "batch-ttft": ("batch_ttft", "interactive time to first token with a Batch API batch running, and without"),
    "step-breakdown": ("step_breakdown", "where an engine step's time goes"),
    "step-interference": ("step_interference", "what other work in the process costs a decode step"),
    "host-cost": ("host_cost", "host cost of a decode step: the engine's against eager transformers"),
    "greedy-agreement": ("greedy_agreement", "how often two dtypes or weight layouts give the same greedy answer"),
    "quantized-quality": ("quantized_quality", "lm-eval scores of server configurations (quantized vs plain)"),
    "realtime": ("realtime_bench", "realtime transcription sessions one server sustains within a latency budget"),
    "whisper-int8": ("whisper_int8_bench", "Whisper transcription: our int8 server against faster-whisper"),
    "neighbour": ("busy_neighbour", "running servers' output beside a process spinning on one core, and after"),
    "random-model": ("random_model", "a random-weight model of a given shape, for GPU measurements"),
    "lora-adapters": ("lora_adapters", "random LoRA adapters in PEFT's format, to serve with `run --models`"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "usage: loadtest SUBCOMMAND [--help | options]\n\nsubcommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"loadtest: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"loadtest.{SUBCOMMANDS[name][0]}")
    sys.argv[0] = f"loadtest {name}"  # argparse's prog in each tool's --help
    return int(module.main(rest) or 0)
