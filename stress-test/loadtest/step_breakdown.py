"""Where an engine step's time goes at a given batch size, measured in process (no HTTP), from the engine's own
per-step phase times (the same ones `/metrics` shows as `engine_step_phase_seconds`).

For each batch size, that many requests of `--max-tokens` tokens each (`ignore_eos`) are added at once to a fresh
engine; the steps that decode the full batch are averaged. Phases: forward (the batched model call), sample (the
sampler, with the model kind's logits processors), output (detokenizing, stop strings, bookkeeping), total.

Decode variants (`--decode`, measured interleaved): `grouped` (the eager step planned row by row, rows in length
groups), `fixed` (persistent buffers at the batch's exact shape, eager), `buckets` (the same padded to the batch and
width buckets, eager), `graphs` (the buckets captured as CUDA graphs), `ahead` (those graphs, each decode step launched
before the last one's tokens are recorded: the server's default on CUDA), `compiled` (the exact-shape decode step
compiled by `torch.compile`: the server's default on a CPU).
`--gpu-time` profiles some full-batch steps (torch profiler) and reports the GPU's busy time per step beside the
step's wall time; `--agreement` compares every row's greedy tokens with `model.generate` of the prompt alone.

Example:
    loadtest step-breakdown --model .cache/models/smollm2-135m-instruct --batch 1,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
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
    decode: str = "grouped",
    gpu_time: bool = False,
    reference: list[int] | None = None,
    profile_rows: int = 0,
) -> dict[str, float]:
    """Mean milliseconds per phase over the steps that decode all `batch` rows (each prompted with `prompt_ids`,
    else the chat-templated story prompt) and the median step (`total_median`), with the `decode` variant; with
    `gpu_time`, also `wall` and `gpu` (profiled full-batch steps); with `reference` (greedy tokens of the prompt
    alone), `agree` (share of rows equal to it) and `first_diff` (earliest position where a row parts from it, -1
    if none does)."""
    from transformers_openai.engine.core import EngineCore
    from transformers_openai.engine.request import EngineRequest
    from transformers_openai.engine.sampling_params import SamplingParams
    from transformers_openai.engine.scheduler import Scheduler
    from transformers_openai.runners.causal_lm import CausalLMRunner
    from transformers_openai.serving.tokenizer import engine_decoder

    steps = _Steps()
    runner = CausalLMRunner(model, max_rows=batch, max_model_len=1024)
    padded = {"graphs": True, "ahead": True, "buckets": True, "fixed": False, "compiled": False}
    compiled = decode == "compiled"  # as the server on a CPU: prompts keep the grouped prefill
    graphs = decode in ("graphs", "ahead")
    if decode != "grouped" and not runner.fix_steps(graphs, padded[decode], compiled, not compiled):
        raise SystemExit(f"{decode}: this model's attention does not take fixed-shape decode steps")
    eos = frozenset({tokenizer.eos_token_id})
    lookahead = decode == "ahead"  # as the server over CUDA graphs
    core = EngineCore(runner, engine_decoder(tokenizer), Scheduler(batch, batch), eos, steps, lookahead=lookahead)
    messages = [{"role": "user", "content": PROMPT}]
    ids = prompt_ids or tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=True)
    constraints: list[Any] = []
    if json_rows:
        from transformers_openai.serving.text.structured_output import StructuredOutputs

        constraints = StructuredOutputs(tokenizer).constraints(STORY_SCHEMA, min(json_rows, batch), "json")
    for i in range(batch):
        constraint = constraints[i] if i < len(constraints) else None
        core.add(EngineRequest(f"r{i}", list(ids), params, constraint=constraint))
    tokens: dict[str, list[int]] = {}
    profiled: dict[str, float] = {}
    while core.has_work():
        if gpu_time and not profiled and len(steps.steps) >= 4 and max_tokens - len(steps.steps) > 16:
            profiled = _profile(core, tokens, 12, profile_rows)
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    full = [s.phase_s for s in steps.steps if s.batch_size == batch][1:]  # the first may include its prefill
    phases = ("forward", "sample", "output", "total")
    result = {phase: 1e3 * statistics.mean(step.get(phase, 0.0) for step in full) for phase in phases}
    result["total_median"] = 1e3 * statistics.median(step.get("total", 0.0) for step in full)
    result |= profiled
    result["replays"] = float(runner.fixed.replays if runner.fixed is not None else 0)  # CUDA graph replays
    if reference is not None:
        rows = list(tokens.values())
        result["agree"] = sum(row == reference for row in rows) / len(rows)
        parted = [next((i for i, (a, b) in enumerate(zip(row, reference, strict=False)) if a != b), -1) for row in rows]
        result["first_diff"] = min((p for p in parted if p >= 0), default=-1)
    return result


def _profile(core: Any, tokens: dict[str, list[int]], count: int, table_rows: int = 0) -> dict[str, float]:
    """Wall and GPU-busy milliseconds per step over `count` steps (the GPU's: the sum of its kernels' and copies'
    own times, from torch's profiler); `table_rows` > 0 prints the profiler's top operations by host and by GPU
    time."""
    import time

    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(count):
            for output in core.step():
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    if table_rows:
        for key in ("self_cpu_time_total", "self_device_time_total"):
            print(averages.table(sort_by=key, row_limit=table_rows, max_name_column_width=60), flush=True)
    busy_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
    return {"wall": 1e3 * wall / count, "gpu": busy_us / 1e3 / count}


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
        "--decode",
        default="grouped",
        help="comma-separated decode variants, measured interleaved: "
        "grouped, fixed, buckets, graphs, ahead, compiled (default: %(default)s)",
    )
    parser.add_argument("--gpu-time", action="store_true", help="GPU busy time per step (CUDA, torch profiler)")
    parser.add_argument("--agreement", action="store_true", help="rows' greedy tokens against model.generate")
    parser.add_argument(
        "--profile-table",
        type=int,
        default=0,
        metavar="N",
        help="with --gpu-time: print the profiler's top N operations by host and by GPU time",
    )
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--weights",
        default="packed",
        help="comma-separated: packed (oneDNN's packed products), gemv (those and the matrix-vector kernel for 1-4 "
        "rows: the server's CPU default for float32), plain (nn.Linear); "
        "several are measured interleaved, batch by batch (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_openai.runners.packed_linear import pack_linear_layers

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    models = {}
    for weights in args.weights.split(","):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
        model = model.to(args.device).eval()
        kernels = Path(tempfile.mkdtemp(prefix="step-breakdown-")) if weights == "gemv" else None
        if weights in ("packed", "gemv") and args.device == "cpu" and not pack_linear_layers(model, kernels):
            parser.error("this CPU or torch build cannot pack the weights for oneDNN")
        models[weights] = model
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top_p {args.top_p}"
    sampling += f", {args.json_rows} rows bound to a JSON schema" if args.json_rows else ""
    print(
        f"{args.model.name}, {args.dtype} on {args.device}, {args.threads} thread(s), {args.max_tokens} tokens each, "
        f"{sampling}"
    )
    reference = None
    if args.agreement:
        if args.temperature != 0:
            parser.error("--agreement compares greedy answers: leave --temperature at 0")
        reference = _generate(next(iter(models.values())), tokenizer, args.max_tokens)
    extra = ["wall ms", "GPU ms", "wall/GPU"] if args.gpu_time else []
    extra += ["agree", "first diff"] if args.agreement else []
    head = ["weights", "decode", "batch", "forward ms", "sample ms", "output ms", "total ms", "tok/s", "replays"]
    head += extra
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for weights, model in models.items():
            for decode in args.decode.split(","):
                ms = breakdown(
                    model,
                    tokenizer,
                    batch,
                    args.max_tokens,
                    args.temperature,
                    args.top_p,
                    args.json_rows,
                    decode=decode,
                    gpu_time=args.gpu_time,
                    reference=reference,
                    profile_rows=args.profile_table,
                )
                rate = batch / ms["total"] * 1e3
                cells = [f"{ms[p]:.1f}" for p in ("forward", "sample", "output", "total")]
                cells += [f"{rate:.0f}", str(int(ms["replays"]))]
                if args.gpu_time:
                    cells += [f"{ms['wall']:.2f}", f"{ms['gpu']:.2f}", f"{ms['wall'] / ms['gpu']:.2f}"]
                if args.agreement:
                    cells += [f"{ms['agree']:.2f}", str(int(ms["first_diff"]))]
                print(f"| {weights} | {decode} | {batch} | " + " | ".join(cells) + " |", flush=True)
                rows.append({"weights": weights, "decode": decode, "batch": batch, **ms})
    if args.out:
        import json

        meta = {
            "model": str(args.model),
            "dtype": args.dtype,
            "device": args.device,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "torch": torch.__version__,
        }
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
        args.out.write_text(json.dumps({"config": meta, "rows": rows}, indent=1))
    return 0


def _generate(model: Any, tokenizer: Any, max_tokens: int) -> list[int]:
    """The greedy answer of `model.generate` to the story prompt alone (`max_tokens` tokens, EOS ignored)."""
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt = torch.tensor([ids], device=model.device)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
    )
    return [int(t) for t in out[0, prompt.shape[1] :]]


if __name__ == "__main__":
    sys.exit(main())
