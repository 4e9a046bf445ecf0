"""Peak memory of the engine when one long prompt runs among short ones (the KV-cache layout's cost).

The scenario: `--short` requests with short chat prompts and one request with a `--long-tokens` prompt, all added at
once to an engine built exactly as the server builds it (`load_serving_context` with the server's defaults unless
flags say otherwise), each generating `--max-tokens` tokens (`ignore_eos`). It runs in process, without HTTP.

Reported: resident memory (RSS) idle after loading and its peak during the run (CPU), and on CUDA
`torch.cuda.max_memory_allocated` after loading and during the run; an estimate of the K/V the live tokens
need (layers x 2 x K/V heads x head dim x bytes x tokens at the peak), to compare with what the cache holds; and
the K/V pool, its size and the most blocks held at once, and the preemptions.

Example:
    loadtest kv-memory --model .cache/models/smollm2-135m-instruct
    loadtest kv-memory --model /tmp/llama-1b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SHORT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
FILLER = "The quick brown fox jumps over the lazy dog while the old lighthouse keeper watches the sea. "


def rss_gb() -> float:
    """The current resident set size."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 1e9


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def long_prompt(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = tokenizer(FILLER * (n // 10 + 10))["input_ids"]
    return ids[:n]


def kv_bytes_per_token(model: Any) -> int:
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers * 2 * heads * head_dim * model.dtype.itemsize)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from transformers_openai.engine.async_engine import AsyncEngine
    from transformers_openai.engine.request import EngineRequest
    from transformers_openai.engine.sampling_params import SamplingParams
    from transformers_openai.model_loader import load_serving_context
    from transformers_openai.settings import Settings

    flags = {"model": str(args.model), "device": args.device, "dtype": args.dtype, "torch_threads": args.threads}
    if args.max_batch_size:
        flags["max_batch_size"] = args.max_batch_size
    if args.kv_cache_memory:
        flags["kv_cache_memory"] = args.kv_cache_memory
    settings = Settings(**flags)
    context = load_serving_context(settings)
    assert isinstance(context.engine, AsyncEngine)
    core = context.engine._core  # driven synchronously here: no engine thread is started
    runner: Any = core.runner
    model, tokenizer = runner.model, AutoTokenizer.from_pretrained(args.model)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    idle = {"rss_gb": round(rss_gb(), 3)}
    if cuda:
        idle["cuda_allocated_gb"] = round(torch.cuda.memory_allocated() / 1e9, 3)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    short = tokenizer.apply_chat_template(
        [{"role": "user", "content": SHORT_PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompts = [list(short) for _ in range(args.short)] + [long_prompt(tokenizer, args.long_tokens)]
    for i, ids in enumerate(prompts):
        core.add(EngineRequest(f"r{i}", ids, params))
    live_peak = blocks_peak = preemptions = 0
    start = time.perf_counter()
    while core.has_work():
        core.step()
        running = core.scheduler.running.values()
        live_peak = max(live_peak, sum(seq.prompt_len + len(seq.output_ids) for seq in running))
        blocks_peak = max(blocks_peak, core.kv.usage().blocks_used)
        preemptions = max(preemptions, max((seq.preemptions for seq in running), default=0))
    elapsed = time.perf_counter() - start
    report: dict[str, Any] = {
        "model": args.model.name,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_batch_size": settings.batch_rows("causal-lm"),
        "requests": f"{args.short} x {len(short)}-token prompts + 1 x {len(prompts[-1])}-token prompt, "
        f"{args.max_tokens} tokens each",
        "idle": idle,
        "peak_rss_gb": round(peak_rss_gb(), 3),
        "live_kv_gb_at_peak": round(live_peak * kv_bytes_per_token(model) / 1e9, 3),
        "seconds": round(elapsed, 1),
    }
    usage = core.kv.usage()
    block_size = settings.kv_block_size
    report["kv_pool"] = {
        "blocks": usage.blocks_total,
        "block_size": block_size,
        "gb": round(usage.blocks_total * block_size * kv_bytes_per_token(model) / 1e9, 3),
        "peak_blocks_used": blocks_peak,
        "peak_gb_used": round(blocks_peak * block_size * kv_bytes_per_token(model) / 1e9, 3),
        "most_preemptions_of_one_request": preemptions,
    }
    if cuda:
        report["cuda_max_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="float32")
    p.add_argument("--short", type=int, default=15, help="short requests (default: %(default)s)")
    p.add_argument("--long-tokens", type=int, default=3000, help="the long prompt's tokens (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=0, help="0: the server's default")
    p.add_argument("--kv-cache-memory", help="the server's --kv-cache-memory (default: the server's default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
