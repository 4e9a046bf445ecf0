"""What the engine reports about its work: per-step and per-request statistics, to any observer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from transformers_openai.engine.kv_manager import KVUsage

# Where a step's time goes: prompts in, the batched forward, sampling, turning tokens into outputs (detokenizing,
# stop strings, bookkeeping); "total" is the whole step.
STEP_PHASES = ("prefill", "forward", "sample", "output")


@dataclass
class SpecCounts:
    """What one step speculated: drafts verified, their tokens, the tokens accepted, and per draft position how
    many were accepted (vLLM's `spec_decode_*` counters)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ThreadsReport:
    """The engine thread's torch threads on a CPU now, and how often they fell back to fewer (a running total)."""

    threads: int
    fallbacks: int


@dataclass(frozen=True)
class StepStats:
    running: int
    waiting: int
    batch_size: int  # rows advanced by this step's decode (0 when only prefills ran)
    rows_in_use: int
    max_rows: int
    prompt_tokens: int  # prefilled this step
    generation_tokens: int  # sampled this step
    inter_token_latencies_s: list[float]
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds per STEP_PHASES entry that ran, and "total"
    kv: KVUsage | None = None  # the K/V pool after the step
    preemptions: int = 0  # requests preempted in this step
    threads: ThreadsReport | None = None  # on a CPU: the torch threads of the next step
    spec: SpecCounts | None = None  # what the step speculated (speculative decoding)


class PhaseClock:
    """Adds up the seconds spent in each phase of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def done(self) -> dict[str, float]:
        return {**self.seconds, "total": time.perf_counter() - self._start}


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float
    time_to_first_token_s: float | None
    e2e_latency_s: float
    decode_tokens_per_s: float
    aborted: bool  # ended from outside (its client left, stopped reading, or the server shut down)


class EngineObserver(Protocol):
    """Receives statistics on the engine thread; implementations must be thread-safe and fast."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_finished(self, request: FinishedRequest) -> None: ...

    def on_stream_stalled(self) -> None: ...


class NullObserver:
    def on_step(self, stats: StepStats) -> None:
        return None

    def on_finished(self, request: FinishedRequest) -> None:
        return None

    def on_stream_stalled(self) -> None:
        return None
