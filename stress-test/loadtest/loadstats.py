"""Per-request records and per-level summaries for the load generator (pure functions, no I/O)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

OK = "ok"
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `start_s` is relative to the start of its level."""

    status: str = OK  # "ok", "http_<code>", "timeout", "connection", "stream_error", "empty", "cancelled"
    start_s: float = 0.0
    e2e_s: float = 0.0
    ttft_s: float | None = None  # send -> first chunk carrying text (streaming workloads only)
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks carrying text
    output_tokens: int = 0
    detail: str = ""  # first bytes of an error body or exception text
    retry_after_s: float | None = None  # Retry-After of a 429
    audio_s: float = 0.0  # seconds of audio transcribed (transcription)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/mean/max in milliseconds (rounded to 0.01 ms) and the sample count."""
    values = [v * 1e3 for v in values_s]
    out: dict[str, float | int | None] = {f"p{q:g}": _round(percentile(values, q)) for q in PERCENTILES}
    out["mean"] = _round(sum(values) / len(values)) if values else None
    out["max"] = _round(max(values)) if values else None
    out["n"] = len(values)
    return out


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests by kind, e.g. {"http_429": 3, "timeout": 1}; sorted by kind."""
    counts = Counter(r.status for r in records if not r.ok)
    return dict(sorted(counts.items()))


def level_wall_s(records: Sequence[RequestRecord]) -> float:
    """From the level's start to the end of its last request (0 when there were none)."""
    return max((r.start_s + r.e2e_s for r in records), default=0.0)


def summarize_level(
    mode: str,
    load: float,
    records: Sequence[RequestRecord],
    issue_window_s: float | None = None,
    stopped_by: str = "",
) -> dict[str, Any]:
    """One level's summary: latency percentiles of successful requests, throughput and errors of all.

    Throughputs divide by the wall time from the level's start to its last completion (drain included);
    `issued_per_s` divides the requests issued by the time spent issuing (default: up to the last start).
    """
    wall = level_wall_s(records)
    window = max((r.start_s for r in records), default=0.0) if issue_window_s is None else issue_window_s
    good = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in good)
    errors = error_counts(records)
    first_error = next((f"{r.status}: {r.detail}" for r in records if not r.ok), "")
    retry_after = [r.retry_after_s for r in records if r.retry_after_s is not None]
    return {
        "mode": mode,
        "load": load,
        "requests": len(records),
        "ok": len(good),
        "failed": len(records) - len(good),
        "rejected_429": errors.get("http_429", 0),
        "errors": errors,
        "first_error": first_error[:300],
        "retry_after_s_max": max(retry_after) if retry_after else None,
        "stopped_by": stopped_by,
        "wall_s": round(wall, 3),
        "issue_window_s": round(window, 3),
        "issued_per_s": _rate(len(records), window),
        "output_tokens": tokens,
        "output_tokens_per_s": _rate(tokens, wall),
        "requests_per_s": _rate(len(good), wall),
        "output_tokens_per_request_mean": round(tokens / len(good), 2) if good else None,
        "audio_seconds_per_s": _rate(sum(r.audio_s for r in good), wall),
        "ttft_ms": distribution_ms(r.ttft_s for r in good if r.ttft_s is not None),
        "itl_ms": distribution_ms(gap for r in good for gap in r.itl_s),
        "tpot_ms": distribution_ms(t for r in good if (t := r.tpot_s) is not None),
        "e2e_ms": distribution_ms(r.e2e_s for r in good),
    }


def _rate(count: float, seconds: float) -> float | None:
    return round(count / seconds, 3) if seconds > 0 else None


def record_to_json(record: RequestRecord) -> dict[str, Any]:
    """A compact JSON form of one record (milliseconds, rounded) for the optional raw file."""
    return {
        "status": record.status,
        "start_ms": round(record.start_s * 1e3, 1),
        "e2e_ms": round(record.e2e_s * 1e3, 1),
        "ttft_ms": None if record.ttft_s is None else round(record.ttft_s * 1e3, 1),
        "itl_ms": [round(gap * 1e3, 2) for gap in record.itl_s],
        "output_tokens": record.output_tokens,
        "detail": record.detail,
    }


def progress_line(level: dict[str, Any]) -> str:
    ttft, e2e = level["ttft_ms"]["p50"], level["e2e_ms"]["p50"]
    return (
        f"{level['mode']}={level['load']:g}: {level['ok']}/{level['requests']} ok, "
        f"{level['output_tokens_per_s']} tok/s, {level['requests_per_s']} req/s, "
        f"TTFT p50 {ttft} ms, E2E p50 {e2e} ms, errors {level['errors'] or 'none'} ({level['stopped_by']})"
    )


def markdown_table(levels: list[dict[str, Any]]) -> str:
    head = ["load", "ok", "failed", "tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "E2E p50", "E2E p99"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in levels:
        cells = [lv["load"], lv["ok"], lv["failed"], lv["output_tokens_per_s"], lv["requests_per_s"]]
        cells += [lv["ttft_ms"]["p50"], lv["ttft_ms"]["p99"], lv["itl_ms"]["p50"], lv["e2e_ms"]["p50"]]
        cells += [lv["e2e_ms"]["p99"]]
        lines.append("| " + " | ".join("-" if c is None else f"{c:g}" for c in cells) + " |")
    return "\n".join(lines)
