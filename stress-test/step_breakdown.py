"""Where an engine step's time goes at a given batch size, measured in process (no HTTP), from the engine's own
per-step phase times (the same ones `/metrics` shows as `engine_step_phase_seconds`).

For each batch size, that many requests of `--max-tokens` tokens each (`ignore_eos`) are added at once to a fresh
engine; the steps that decode the full batch are averaged. Phases: forward (the batched model call), sample (the
sampler, with the model kind's logits processors), output (detokenizing, stop strings, bookkeeping), total.

Example:
    python stress-test/step_breakdown.py --model .cache/models/smollm2-135m-instruct --batch 1,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class _Steps:
    """An engine observer that keeps every step's statistics."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def on_step(self, stats: Any) -> None:
        self.steps.append(stats)

    def on_finished(self, request: Any) -> None:
        return None

    def on_stream_stalled(self) -> None:
        return None


# What `--json-rows` rows must follow: a string long enough to last the whole run.
STORY_SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def breakdown(
    model: Any,
    tokenizer: Any,
    batch: int,
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    json_rows: int = 0,
    prompt_ids: list[int] | None = None,
) -> dict[str, float]:
    """Mean milliseconds per phase over the steps that decode all `batch` rows (each prompted with `prompt_ids`,
    else the chat-templated story prompt)."""
    from transformers_openai.engine.core import EngineCore
    from transformers_openai.engine.request import EngineRequest
    from transformers_openai.engine.sampling_params import SamplingParams
    from transformers_openai.engine.scheduler import Scheduler
    from transformers_openai.runners.causal_lm import CausalLMRunner
    from transformers_openai.serving.tokenizer import engine_decoder

    steps = _Steps()
    runner = CausalLMRunner(model, max_rows=batch, max_model_len=1024)
    eos = frozenset({tokenizer.eos_token_id})
    core = EngineCore(runner, engine_decoder(tokenizer), Scheduler(batch, batch), eos, steps)
    messages = [{"role": "user", "content": PROMPT}]
    ids = prompt_ids or tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=True)
    constraints: list[Any] = []
    if json_rows:
        from transformers_openai.serving.structured_output import StructuredOutputs

        constraints = StructuredOutputs(tokenizer).constraints(STORY_SCHEMA, min(json_rows, batch), "json")
    for i in range(batch):
        constraint = constraints[i] if i < len(constraints) else None
        core.add(EngineRequest(f"r{i}", list(ids), params, constraint=constraint))
    while core.has_work():
        core.step()
    full = [s.phase_s for s in steps.steps if s.batch_size == batch][1:]  # the first may include its prefill
    phases = ("forward", "sample", "output", "total")
    return {phase: 1e3 * statistics.mean(step.get(phase, 0.0) for step in full) for phase in phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--json-rows", type=int, default=0, help="rows bound to a JSON schema (structured output)")
    parser.add_argument(
        "--weights", default="packed", help="comma-separated: packed (the server's CPU default), plain (nn.Linear); "
        "several are measured interleaved, batch by batch (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_openai.packed_linear import pack_linear_layers

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    models = {}
    for weights in args.weights.split(","):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
        model = model.to(args.device).eval()
        if weights == "packed" and args.device == "cpu" and not pack_linear_layers(model):
            parser.error("this CPU or torch build cannot pack the weights for oneDNN")
        models[weights] = model
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top_p {args.top_p}"
    sampling += f", {args.json_rows} rows bound to a JSON schema" if args.json_rows else ""
    print(f"{args.model.name}, {args.dtype} on {args.device}, {args.threads} thread(s), {args.max_tokens} tokens each, "
          f"{sampling}")
    print("| weights | batch | forward ms | sample ms | output ms | total ms | tok/s |\n|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        for weights, model in models.items():
            ms = breakdown(model, tokenizer, batch, args.max_tokens, args.temperature, args.top_p, args.json_rows)
            rate = batch / ms["total"] * 1e3
            cells = " | ".join(f"{ms[p]:.1f}" for p in ("forward", "sample", "output", "total"))
            print(f"| {weights} | {batch} | {cells} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
