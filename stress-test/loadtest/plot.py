"""Graphs of load-generator summaries (`loadtest run` --out ...), as PNG files.

For each load mode found in the inputs (concurrency sweeps, rate sweeps) it writes:

* `latency-<mode>.png`: TTFT p50/p90/p99, ITL p50/p99 and E2E p50/p99 against the load;
* `throughput-<mode>.png`: output tokens/s and completed requests/s against the load, with the
  failed requests of each level written next to its point (and, for rate sweeps, the offered rate).

Several summaries of the same mode (e.g. two servers, or CPU and GPU) are drawn in one graph, one
colour per summary; `--label` names them (default: the file name).

A report of `compare.py` becomes `compare-<endpoint>[-<name>].png`: throughput (output tokens/s, or seconds of
audio per second for transcription) and TTFT p50 against concurrency, one line per target, the one-at-a-time
`generate` loop as a dashed level.

Example:
    loadtest plot results/summary-*.json --out-dir results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

X_LABELS = {
    "concurrency": "concurrency (closed-loop users)",
    "rate": "offered load (requests/s, Poisson arrivals)",
}
STYLES = {"p50": "-", "p90": "--", "p99": ":"}
DPI = 100


@dataclass
class Series:
    """One summary file, ready to plot."""

    label: str
    mode: str
    summary: dict[str, Any]

    @property
    def levels(self) -> list[dict[str, Any]]:
        return sorted(self.summary.get("levels", []), key=lambda level: level["load"])

    @property
    def loads(self) -> list[float]:
        return [float(level["load"]) for level in self.levels]

    def metric(self, key: str, stat: str | None = None, scale: float = 1.0) -> list[float]:
        """One value per level (NaN where missing), e.g. metric("ttft_ms", "p99")."""
        out = []
        for level in self.levels:
            value = level.get(key)
            if stat is not None:
                value = (value or {}).get(stat)
            out.append(math.nan if value is None else float(value) * scale)
        return out


def load_series(paths: list[Path], labels: list[str]) -> list[Series]:
    series = []
    for i, path in enumerate(paths):
        summary = json.loads(path.read_text())
        if "levels" not in summary or "mode" not in summary:
            raise SystemExit(f"{path}: not a loadgen summary (no 'mode'/'levels')")
        label = labels[i] if i < len(labels) else path.stem
        series.append(Series(label, str(summary["mode"]), summary))
    return series


def subtitle(series: list[Series]) -> str:
    """Model, workload and machine of the first summary (all of them share the graph)."""
    first = series[0].summary
    config, machine = first.get("config", {}), first.get("machine", {})
    model = Path(str(first.get("model", "?"))).name
    if machine.get("server_spawned_here"):
        threads = machine.get("server_torch_threads") or "default"
        where = f"server on this {machine.get('cpu_count')}-CPU machine, torch threads {threads}"
    else:
        where = "server at --url"
    return f"{model} | {config.get('workload')}, max_tokens {config.get('max_tokens')} | {where}"


def style_axis(ax: Axes, mode: str, loads: list[float], ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(loads))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{x:g}" for x in sorted(set(loads))])
    ax.set_xlabel(X_LABELS.get(mode, mode))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.08)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def color_for(series_index: int, stat_index: int, many: bool) -> str:
    """One colour per summary when there are several, else one per percentile."""
    return f"C{series_index if many else stat_index}"


def plot_percentiles(ax: Axes, series: list[Series], key: str, stats: list[str], scale: float = 1.0) -> None:
    many = len(series) > 1
    for si, s in enumerate(series):
        for pi, stat in enumerate(stats):
            label = f"{s.label} {stat}" if many else stat
            values = s.metric(key, stat, scale)
            ax.plot(s.loads, values, STYLES[stat], marker="o", ms=4, color=color_for(si, pi, many), label=label)


def latency_figure(series: list[Series], mode: str, out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    loads = [x for s in series for x in s.loads]
    plot_percentiles(axes[0], series, "ttft_ms", ["p50", "p90", "p99"])
    style_axis(axes[0], mode, loads, "TTFT (ms)", "Time to first token")
    plot_percentiles(axes[1], series, "itl_ms", ["p50", "p99"])
    style_axis(axes[1], mode, loads, "inter-token latency (ms)", "Inter-token latency")
    plot_percentiles(axes[2], series, "e2e_ms", ["p50", "p99"], scale=1e-3)
    style_axis(axes[2], mode, loads, "E2E latency (s)", "End-to-end request latency")
    fig.suptitle(f"Latency vs {mode}  ({subtitle(series)})", fontsize=11)
    return save(fig, out / f"latency-{mode}.png")


def annotate_failures(ax: Axes, s: Series, values: list[float]) -> None:
    """Write the failed requests by kind (e.g. "http_429 x12") above each level that had any."""
    for level, x, y in zip(s.levels, s.loads, values, strict=True):
        if level.get("failed"):
            kinds = ", ".join(f"{k} x{n}" for k, n in level.get("errors", {}).items())
            xy = (x, 0.0 if math.isnan(y) else y)
            ax.annotate(kinds, xy, textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7, color="red")


def throughput_figure(series: list[Series], mode: str, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    loads = [x for s in series for x in s.loads]
    for si, s in enumerate(series):
        name = s.label if len(series) > 1 else None
        tok, req = s.metric("output_tokens_per_s"), s.metric("requests_per_s")
        axes[0].plot(s.loads, tok, "-", marker="o", ms=4, color=f"C{si}", label=name or "output tokens/s")
        axes[1].plot(s.loads, req, "-", marker="o", ms=4, color=f"C{si}", label=name or "completed requests/s")
        annotate_failures(axes[1], s, req)
    if mode == "rate":
        ticks = sorted(set(loads))
        axes[1].plot(ticks, ticks, ":", color="grey", label="offered rate (nominal)")
        for si, s in enumerate(series):
            issued = s.metric("issued_per_s")
            axes[1].plot(s.loads, issued, "x", color=f"C{si}", label="issued/s (this Poisson sample)")
    style_axis(axes[0], mode, loads, "output tokens/s", "Output token throughput")
    style_axis(axes[1], mode, loads, "requests/s", "Completed requests/s (failures in red)")
    fig.suptitle(f"Throughput vs {mode}  ({subtitle(series)})", fontsize=11)
    return save(fig, out / f"throughput-{mode}.png")


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_all(series: list[Series], out_dir: Path) -> list[Path]:
    """Two PNGs per mode present in the inputs; returns their paths."""
    written = []
    for mode in dict.fromkeys(s.mode for s in series):
        group = [s for s in series if s.mode == mode and s.levels]
        if group:
            written += [latency_figure(group, mode, out_dir), throughput_figure(group, mode, out_dir)]
    return written


def compare_figure(report: dict[str, Any], out: Path) -> Path:
    """Throughput and TTFT p50 of each target of one `compare.py` report against concurrency."""
    config, rows = report["config"], [r for r in report["results"] if r.get("requests")]
    speech = config.get("endpoint") == "transcription"
    key, unit = ("audio_s_per_s", "seconds of audio / s") if speech else ("output_tok_s", "output tokens/s")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for index, target in enumerate(dict.fromkeys(r["target"] for r in rows)):
        mine = [r for r in rows if r["target"] == target]
        if target == "generate-loop":
            for ax, field in ((axes[0], key), (axes[1], "ttft_p50_ms")):
                ax.axhline(mine[0][field] or 0, ls="--", color=f"C{index}", label="generate, one at a time")
            continue
        loads = [r["concurrency"] for r in mine]
        axes[0].plot(loads, [r[key] for r in mine], "-", marker="o", ms=4, color=f"C{index}", label=target)
        axes[1].plot(loads, [r["ttft_p50_ms"] for r in mine], "-", marker="o", ms=4, color=f"C{index}", label=target)
    concurrency = sorted({r["concurrency"] for r in rows})
    style_axis(axes[0], "concurrency", concurrency, unit, "Throughput")
    style_axis(axes[1], "concurrency", concurrency, "ms", "Time to first text (p50)" if speech else "TTFT p50")
    threads = config.get("threads")
    fig.suptitle(f"{config.get('endpoint')}: {Path(str(config.get('model'))).name}, {threads} torch thread(s) each")
    return save(fig, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summaries", nargs="+", type=Path, help="JSON of loadgen.py --out or compare.py --out")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path("results"),
        help="where the PNGs go (default: ./results)",
    )
    p.add_argument("--label", action="append", default=[], help="legend name of each summary, in order; repeatable")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports = {path: json.loads(path.read_text()) for path in args.summaries}
    compared = [path for path, report in reports.items() if "results" in report and "config" in report]
    written = [compare_figure(reports[path], args.out_dir / f"{path.stem}.png") for path in compared]
    summaries = [path for path in args.summaries if path not in compared]
    if summaries:
        written += plot_all(load_series(summaries, args.label), args.out_dir)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
