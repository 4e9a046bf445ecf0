"""How often two ways of running one model give the same greedy answer: float32 vs bfloat16, plain vs packed weights,
float vs int8 layers.

Every prompt of the benchmark's chat mix (`compare.py`) and the load tool's (`loadclient.py`) is answered greedily
(`generate`, one prompt at a time, `--max-tokens` new tokens, EOS allowed) by each variant; the report gives the
share of identical answers and, for the others, the first position where they part.

A variant is `DTYPE:WEIGHTS`, WEIGHTS being `plain` (`nn.Linear`), `packed` (the server's CPU default, see
`transformers_openai/runners/packed_linear.py`), `int8` (`--quantization int8-dynamic` with int8 products, the output
layer packed float) or `int8-output` (the output layer in int8 too: `--int8-output-layer`). Example:

    loadtest greedy-agreement --reference float32:plain --candidate float32:packed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.compare import DEFAULT_MODEL
from loadtest.compare import PROMPTS as CHAT_PROMPTS
from loadtest.loadclient import PROMPTS as LOAD_PROMPTS


def load(model_dir: Path, variant: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from transformers_openai.int8_linear import quantize_linear_layers
    from transformers_openai.runners.packed_linear import pack_linear_layers

    dtype_name, weights = variant.split(":")
    # Any: transformers types `PreTrainedModel.to` as its decorated function, which takes no device.
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    model = model.to(device).eval()
    if weights.startswith("int8"):
        quantize_linear_layers(model, output_layer=weights == "int8-output")
        pack_linear_layers(model)  # the float layers left, as the server packs them
    elif weights == "packed" and not pack_linear_layers(model):
        raise SystemExit(f"{variant}: this CPU or torch build cannot pack {dtype_name} weights")
    return model


def answers(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    out = []
    with torch.inference_mode():
        for ids in prompts:
            prompt = torch.tensor([ids], device=model.device)
            generated = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens, do_sample=False
            )
            out.append(generated[0, len(ids) :].tolist())
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--reference", default="float32:plain", help="DTYPE:WEIGHTS (default: %(default)s)")
    parser.add_argument("--candidate", default="float32:packed", help="DTYPE:WEIGHTS (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help="JSON report (default: results/agreement-<time>.json)")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer: Any = AutoTokenizer.from_pretrained(args.model)  # apply_chat_template's type depends on its flags
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for text in (*CHAT_PROMPTS, *LOAD_PROMPTS)
    ]
    results = {}
    for variant in (args.reference, args.candidate):
        start = time.perf_counter()
        results[variant] = answers(load(args.model, variant, args.device), prompts, args.max_tokens)
        print(f"{variant}: {len(prompts)} answers in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    parted = [first_difference(a, b) for a, b in zip(results[args.reference], results[args.candidate], strict=True)]
    differing = [p for p in parted if p is not None]
    report = {
        "model": args.model.name,
        "reference": args.reference,
        "candidate": args.candidate,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "identical": len(prompts) - len(differing),
        "identical_share": round((len(prompts) - len(differing)) / len(prompts), 3),
        "first_difference_positions": sorted(differing),
        "median_first_difference": statistics.median(differing) if differing else None,
    }
    print(
        f"{args.candidate} vs {args.reference}, {args.model.name}, {len(prompts)} prompts, greedy, "
        f"{args.max_tokens} tokens: {report['identical']} identical ({report['identical_share']:.0%}); "
        f"the others part at tokens {sorted(differing)}"
    )
    out = args.out or Path("results") / f"agreement-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
