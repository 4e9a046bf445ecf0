"""What the engine reports about its work: per-step and per-request statistics, to any observer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    client_disconnected: bool


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
