"""What a decode step costs the host: the engine's step against a plain eager transformers decode step, on a model of
real depth and almost no width, so that the time measured is the host's (Python, dispatch, kernel launches), not
arithmetic.

The model is a random Llama of `--layers` layers of hidden size `--hidden` (16 and 64 by default) whose vocabulary
is the first `--vocab` tokens of SmolLM2's tokenizer (1024 by default: with the full 49,152 the output layer's
arithmetic alone outweighs the host at 16 rows and more). For each batch size, interleaved `--repeat` times:

- transformers: `model(input_ids, past_key_values=DynamicCache)` for one new token per row, after a prefill of the
  same prompt, over `--steps` forwards (no sampling: that baseline does less than a step of ours);
- engine: the engine's whole decode step (`EngineCore.step`: forward over the paged K/V pool, sampling, detokenizing
  and bookkeeping), over the steps that decode all rows; `--decode` names the step variants measured
  (`step_breakdown.py`'s: grouped, fixed, buckets, compiled), interleaved, the first one reported as `engine_ms`.

Each side's step time is its median step (`..._ms`; the mean is kept beside it as `..._mean_ms`): on a shared machine a
burst of another tenant's work lands on a few steps of one side and moves a mean by up to 2x, a median hardly.

Example:
    loadtest host-cost --batch 1,16,64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def build_model(directory: Path, layers: int, hidden: int, vocab: int) -> Path:
    """A random Llama with `layers` layers of width `hidden` over `vocab` of SmolLM2's tokens, saved once into
    `directory`."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.model_factory import SMOLLM2_GGUF, smollm2_gguf_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def transformers_step_ms(model: Any, prompt: list[int], batch: int, steps: int) -> tuple[float, float]:
    """Median and mean ms of one eager decode forward over a `DynamicCache` of `batch` rows."""
    import torch
    from transformers import DynamicCache

    from transformers_openai.runners.kv.kv_cache import cache_keyword

    keyword = cache_keyword(model)  # `cache` from transformers 5.24, `past_key_values` before it
    with torch.inference_mode():
        cache = DynamicCache()
        ids = torch.tensor([prompt] * batch)
        out = model(input_ids=ids, **{keyword: cache}, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, **{keyword: cache}, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:]), 1e3 * statistics.mean(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--model-dir", type=Path, help="where the random model is kept (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--decode", default="grouped", help="engine step variants (default: %(default)s)")
    args = parser.parse_args(argv)
    variants = args.decode.split(",")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loadtest.step_breakdown import breakdown

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_model(args.model_dir or Path(tmp) / "host-cost-llama", args.layers, args.hidden, args.vocab)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = [t % args.vocab for t in tokenizer("Write a short story about a lighthouse keeper.")["input_ids"]]
    batches = [int(b) for b in args.batch.split(",")]
    rows: list[dict[str, float]] = []
    print(
        f"random Llama, {args.layers} layers of hidden size {args.hidden}, vocabulary {args.vocab}, float32, "
        f"{args.threads} thread(s)"
    )
    print("| repetition | batch | transformers median step ms | engine step | median ms | engine / transformers |")
    print("|---|---|---|---|---|---|")
    for repetition in range(1, args.repeat + 1):
        for batch in batches:
            theirs, theirs_mean = transformers_step_ms(model, prompt, batch, args.steps)
            row: dict[str, float] = {
                "repetition": repetition,
                "batch": batch,
                "transformers_ms": theirs,
                "transformers_mean_ms": theirs_mean,
            }
            for variant in variants:
                steps = breakdown(model, tokenizer, batch, args.steps + 2, prompt_ids=prompt, decode=variant)
                ours = steps["total_median"]
                row[f"engine_{variant}_ms"], row[f"engine_{variant}_mean_ms"] = ours, steps["total"]
                row.setdefault("engine_ms", ours)
                print(
                    f"| {repetition} | {batch} | {theirs:.2f} | {variant} | {ours:.2f} | {ours / theirs:.2f} |",
                    flush=True,
                )
            rows.append(row)
    for batch in batches:
        for variant in variants:
            ratios = [r[f"engine_{variant}_ms"] / r["transformers_ms"] for r in rows if r["batch"] == batch]
            print(f"batch {batch}, {variant}: engine / transformers median {statistics.median(ratios):.2f}")
    if args.json:
        shape = {
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "threads": args.threads,
            "decode": variants,
        }
        args.json.write_text(json.dumps({**shape, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
