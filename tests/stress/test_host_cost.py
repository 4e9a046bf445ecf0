"""The host-cost script runs end to end on a small model and writes one measurement per repetition and batch (not
its figures: those are the script's job)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import host_cost


def test_host_cost_measures_both_steps_per_batch(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    args = [
        "--layers",
        "2",
        "--vocab",
        "512",
        "--batch",
        "1,3",
        "--steps",
        "4",
        "--repeat",
        "2",
        "--model-dir",
        str(tmp_path / "model"),
        "--json",
        str(out),
    ]
    assert host_cost.main(args) == 0
    report = json.loads(out.read_text())
    assert (report["layers"], report["hidden"], report["vocab"]) == (2, 64, 512)
    assert [(row["repetition"], row["batch"]) for row in report["rows"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(row["engine_ms"] > 0 and row["transformers_ms"] > 0 for row in report["rows"])
