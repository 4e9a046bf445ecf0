"""The two ways of applying one level of load: a closed loop of users and an open loop of Poisson arrivals."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.loadclient import RequestSpec, pick_prompt, send
from loadtest.loadstats import RequestRecord


@dataclass
class LevelRun:
    """The requests of one load level: issues them, and keeps their records."""

    client: httpx.AsyncClient
    base_url: str
    spec: RequestSpec
    timeout_s: float
    stop_issuing_at: float  # perf_counter() time
    max_requests: int
    t0: float = field(default_factory=time.perf_counter)
    issued: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    in_flight: int = 0
    issue_stopped_at: float | None = None

    def may_issue(self) -> bool:
        if self.issued < self.max_requests and time.perf_counter() < self.stop_issuing_at:
            return True
        self.issue_stopped_at = self.issue_stopped_at or time.perf_counter()
        return False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def issue_time_left(self) -> float:
        return max(self.stop_issuing_at - time.perf_counter(), 0.0)

    def issue_window_s(self) -> float:
        """How long this level issued requests (for the achieved arrival rate)."""
        return min(self.stop_issuing_at, self.issue_stopped_at or time.perf_counter()) - self.t0

    def stopped_by(self, deadline: float) -> str:
        if self.issued >= self.max_requests:
            return "max_requests"
        return "time_limit" if time.perf_counter() >= deadline else "duration"

    def issue(self) -> Coroutine[Any, Any, RequestRecord]:
        """Count the next request as issued now (so limits hold before it runs); await the result to send it."""
        index, start = self.issued, self.elapsed()
        self.issued += 1
        self.in_flight += 1
        return self._send(index, start)

    async def _send(self, index: int, start: float) -> RequestRecord:
        """Send one request; a cancelled one is still recorded (as "cancelled")."""
        try:
            prompt = pick_prompt(index, self.spec.prompts)
            record = await send(self.client, self.base_url, self.spec.for_request(index), prompt, self.timeout_s)
        except asyncio.CancelledError:
            self.records.append(RequestRecord("cancelled", start, self.elapsed() - start, detail="run time limit"))
            raise
        finally:
            self.in_flight -= 1
        record.start_s = start
        self.records.append(record)
        return record

    def drop(self, reason: str) -> None:
        """Count a request the client did not send (open loop over --max-in-flight)."""
        self.records.append(RequestRecord("client_overflow", self.elapsed(), detail=reason))
        self.issued += 1


def backoff_s(record: RequestRecord, cap_s: float) -> float:
    """Pause of a closed-loop user after a failure, so that instant rejections do not spin."""
    if record.ok:
        return 0.0
    return min(record.retry_after_s if record.retry_after_s is not None else 0.1, cap_s)


async def closed_loop(run: LevelRun, concurrency: int, backoff_cap_s: float) -> None:
    async def user() -> None:
        while run.may_issue():
            record = await run.issue()
            await asyncio.sleep(backoff_s(record, backoff_cap_s))

    await asyncio.gather(*(user() for _ in range(concurrency)))


async def open_loop(run: LevelRun, rate: float, rng: random.Random, max_in_flight: int) -> None:
    tasks: set[asyncio.Task[RequestRecord]] = set()
    next_at = rng.expovariate(rate)
    try:
        while run.may_issue():
            delay = next_at - run.elapsed()
            if delay > 0:  # wait for the next arrival, but not past the end of issuing
                await asyncio.sleep(min(delay, run.issue_time_left()))
                continue
            if run.in_flight >= max_in_flight:
                run.drop(f"over --max-in-flight {max_in_flight}")
            else:
                tasks.add(asyncio.create_task(run.issue()))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
