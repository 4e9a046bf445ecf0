"""The K/V cache scripts run end to end on the tiny Llama and report what they claim (not their figures: timings
and memory are the scripts' job, on a real model)."""

from __future__ import annotations

from pathlib import Path

from loadtest import kv_memory, prefix_ttft


def test_kv_memory_reports_the_pool_and_preempts_under_a_small_budget(tiny_llama_dir: Path) -> None:
    # The tiny Llama's K/V take 512 bytes a token: 64 KiB are 7 blocks of 16 tokens, less than 3 x (20 + 30).
    args = [
        "--model",
        str(tiny_llama_dir),
        "--short",
        "2",
        "--long-tokens",
        "40",
        "--max-tokens",
        "30",
        "--kv-cache-memory",
        "64KiB",
    ]
    report = kv_memory.run(kv_memory.parse_args(args))
    pool = report["kv_pool"]
    assert pool["blocks"] == 7 and pool["block_size"] == 16
    assert 0 < pool["peak_blocks_used"] <= 7
    assert pool["most_preemptions_of_one_request"] >= 1
    assert report["peak_rss_gb"] >= report["idle"]["rss_gb"] > 0


def test_prefix_ttft_reuses_the_history_of_the_cached_turn(tiny_llama_dir: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--history-tokens", "80", "--rounds", "1", "--max-tokens", "2"]
    report = prefix_ttft.run(prefix_ttft.parse_args(args))
    tokens = report["prompt_tokens"]
    assert tokens["cached_turn"] > tokens["cold"] >= 64
    # Every full block of the cold prompt (and of its two generated tokens) is reused by the next turn.
    assert tokens["cached_turn_reused"] == (tokens["cold"] + 2) // 16 * 16
    assert report["ttft_ms_median"]["cold"] > 0 and report["ttft_ms_median"]["cached_turn"] > 0
