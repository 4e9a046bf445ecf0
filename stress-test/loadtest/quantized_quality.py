"""What quantizing costs in quality: the lm-eval tasks of tests/e2e/test_lm_eval.py through our server, once on the
plain weights and once per quantization, on the same model.

Multiple choice (20 questions: acc, acc_norm) and perplexity (10 paragraphs in 32-token windows: word and byte
perplexity, bits per byte), with lm-eval's `local-completions` model, one request at a time. Each configuration is a
server of its own, started and stopped in turn.

    loadtest quantized-quality --model .cache/models/smollm2-135m-instruct \
        --config none --config "--quantization int8-dynamic"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadtest.server import ServerOptions, local_server, machine_info

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tests" / "data" / "lm_eval_tasks"
TASKS = {
    "toa_general_knowledge": ("acc,none", "acc_norm,none"),
    "toa_prose_perplexity": ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"),
}
WINDOW = 32  # as in tests/e2e/test_lm_eval.py


def evaluate(base_url: str, model_dir: Path) -> dict[str, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = {
        "model": "bench",
        "base_url": f"{base_url}/v1/completions",
        "tokenizer": str(model_dir),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 1,
        "max_length": WINDOW + 2,
    }
    here = Path.cwd()
    os.chdir(TASKS_DIR)  # the YAMLs' data_files are relative to their folder
    try:
        result = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=list(TASKS),
            task_manager=TaskManager(include_path=str(TASKS_DIR)),
            batch_size=1,
            bootstrap_iters=0,
        )
    finally:
        os.chdir(here)
    assert result is not None
    return {
        f"{task}:{metric.split(',')[0]}": float(result["results"][task][metric])
        for task, metrics in TASKS.items()
        for metric in metrics
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        help="server arguments of one configuration ('none': the plain weights); repeatable",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("results") / f"quantized-quality-{stamp}.json"
    rows: dict[str, dict[str, float]] = {}
    for config in args.config:
        extra = [] if config == "none" else shlex.split(config)
        options = ServerOptions(
            model=args.model.resolve(),
            log_path=out.with_suffix(f".{len(rows)}.log"),
            torch_threads=args.threads,
            extra_args=["--served-model-name", "bench", "--dtype", "float32", *extra],
        )
        with local_server(options) as base_url:
            rows[config] = evaluate(base_url, args.model.resolve())
        print(config, json.dumps(rows[config]), flush=True)
    report: dict[str, Any] = {"model": str(args.model), "machine": machine_info(True, args.threads), "results": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    metrics = list(next(iter(rows.values())))
    print("| configuration | " + " | ".join(m.split(":")[1] for m in metrics) + " |")
    print("|---|" + "---|" * len(metrics))
    for config, values in rows.items():
        print(f"| {config} | " + " | ".join(f"{values[m]:.4g}" for m in metrics) + " |")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    main()
