"""Time to first token of a chat turn whose long history is already in the prefix cache, against the same turn
with a history the server has not seen.

Each round makes a fresh history of `--history-tokens` tokens (a user message of numbered filler sentences, unique
to the round). First the "cold" request: that history as a one-turn chat (nothing of it cached). Then the "cached"
request: the next turn of that chat (history, the assistant's reply, a new question), whose prompt starts with the
cold request's tokens: its full K/V blocks are reused, only the rest is prefilled. Rounds alternate the two, so the
machine's drift hits both alike. It runs in process on an engine built as the server builds it (no HTTP), one
request at a time.

Example:
    loadtest prefix-ttft --model .cache/models/smollm2-135m-instruct --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def history_text(round_: int, tokens: int) -> str:
    return " ".join(f"Note {round_}.{i}: the harbour light at pier {i * 7 % 31} was logged." for i in range(tokens))


def first_token_ms(core: Any, request: Any) -> float:
    """Adds `request` to an idle engine and steps until its first token; finishes it. Milliseconds to that token."""
    start = time.perf_counter()
    core.add(request)
    first = None
    while core.has_work():
        for output in core.step():
            if first is None and output.token_ids:
                first = (time.perf_counter() - start) * 1000
    assert first is not None
    return first


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from transformers_openai.engine.async_engine import AsyncEngine
    from transformers_openai.engine.request import EngineRequest
    from transformers_openai.engine.sampling_params import SamplingParams
    from transformers_openai.model_loader import load_serving_context
    from transformers_openai.settings import Settings

    settings = Settings(model=str(args.model), device=args.device, dtype=args.dtype, torch_threads=args.threads)
    engine = load_serving_context(settings).engine
    assert isinstance(engine, AsyncEngine)
    core = engine._core  # driven synchronously: no engine thread is started
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def prompt(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def fitted(round_: int) -> str:
        """A history text of about `--history-tokens` tokens."""
        words = args.history_tokens // 4
        while len(tokenizer(history_text(round_, words))["input_ids"]) > args.history_tokens:
            words -= 1
        return history_text(round_, words)

    cold_ms, cached_ms, lengths = [], [], []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        history = [{"role": "user", "content": fitted(round_)}]
        cold = prompt(history)
        turn = prompt(
            [
                *history,
                {"role": "assistant", "content": "Logged."},
                {"role": "user", "content": "Which pier was checked last?"},
            ]
        )
        cold_time = first_token_ms(core, EngineRequest(f"cold{round_}", cold, params))
        hits_before = core.kv.usage().prefix_hits
        cached_time = first_token_ms(core, EngineRequest(f"turn{round_}", turn, params))
        reused = core.kv.usage().prefix_hits - hits_before
        if round_:
            cold_ms.append(cold_time)
            cached_ms.append(cached_time)
            lengths.append((len(cold), len(turn), reused))
    return {
        "model": args.model.name,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "prompt_tokens": {"cold": lengths[0][0], "cached_turn": lengths[0][1], "cached_turn_reused": lengths[0][2]},
        "ttft_ms_median": {
            "cold": round(statistics.median(cold_ms), 1),
            "cached_turn": round(statistics.median(cached_ms), 1),
        },
        "speedup": round(statistics.median(cold_ms) / statistics.median(cached_ms), 1),
        "ttft_ms": {"cold": [round(x, 1) for x in cold_ms], "cached_turn": [round(x, 1) for x in cached_ms]},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="float32")
    p.add_argument("--history-tokens", type=int, default=1000, help="the history's tokens (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds after a warm-up (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = json.dumps(run(args), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
