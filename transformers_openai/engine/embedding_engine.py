"""The engine of an embedding model: requests queue up, its own thread embeds all that wait in length-sorted batches.

Concurrent requests share forwards: the thread takes every request waiting when it wakes, sorts all their inputs by
length, and runs them in batches of at most `max_rows` inputs and `max_tokens` padded tokens, cut where padding
would cost more than another forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from transformers_openai.engine.engine_thread import EngineThread
from transformers_openai.engine.errors import EngineError, EngineOverloaded, EngineStopped
from transformers_openai.engine.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
Vectors = list[np.ndarray]  # one float32 vector per input, in the request's order


class Embedder(Protocol):
    """What the engine needs of a runner (`runners.embedding.EmbeddingRunner`, or a fake in tests)."""

    def embed(self, inputs: list[list[int]]) -> torch.Tensor: ...


@dataclass(frozen=True)
class EmbeddingStats:
    waiting: int  # requests queued for the next round
    in_flight: int  # requests admitted and not answered yet
    requests: int  # answered since start
    inputs: int  # inputs embedded since start
    forwards: int  # batched forwards run since start (fewer than the inputs: they were batched)


@dataclass
class _Job:
    inputs: list[list[int]]
    future: concurrent.futures.Future[Vectors]


# What one more forward costs, in tokens of work, against padding (a short input batched with a long one pays for
# the long one's length). On a CPU, work grows with the padded tokens and a forward's fixed cost is small: about
# 8 ms for MiniLM on the 2-core development CPU, where a batched token costs about 0.25 ms. A GPU forward costs
# about the same for a few tokens as for thousands: there, fewer and fuller forwards win.
CPU_FORWARD_COST_TOKENS = 32
GPU_FORWARD_COST_TOKENS = 2048


def batches(
    lengths: Sequence[int], max_rows: int, max_tokens: int, forward_cost: int = CPU_FORWARD_COST_TOKENS
) -> list[list[int]]:
    """Indexes into `lengths`, shortest first, cut into batches of at most `max_rows` rows and `max_tokens` padded
    tokens (rows x the batch's longest; an input longer than that runs alone) so that the padded tokens plus
    `forward_cost` per forward are fewest: inputs of very different lengths go to different forwards."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sizes = [lengths[i] for i in order]
    # best[j]: the least cost of the first j inputs; cut[j]: where the last batch of that best split starts.
    best = [0] + [0] * len(sizes)
    cut = [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):
        best[j] = best[j - 1] + forward_cost + sizes[j - 1]  # the j-th input alone
        cut[j] = j - 1
        for i in range(j - 2, max(j - max_rows, 0) - 1, -1):  # the batch holds inputs i..j-1
            padded = (j - i) * sizes[j - 1]
            if padded > max_tokens:
                break
            if best[i] + forward_cost + padded < best[j]:
                best[j], cut[j] = best[i] + forward_cost + padded, i
    found: list[list[int]] = []
    j = len(sizes)
    while j > 0:
        found.append(order[cut[j] : j])
        j = cut[j]
    return found[::-1]


class EmbeddingEngine(EngineThread[Embedder]):
    """Thread-safe bridge between the event loop and the thread that runs the embedding model.

    `embed` admits a request at once (raises `EngineOverloaded` when `max_requests` are in flight) and resolves
    when its vectors are ready; a caller that is cancelled before its batch starts costs no forward.
    """

    def __init__(
        self,
        runner: Embedder,
        max_rows: int,
        max_tokens: int,
        max_requests: int,
        threads: int,
        forward_cost: int = CPU_FORWARD_COST_TOKENS,
    ) -> None:
        super().__init__("embedding-engine", runner)
        self.runner = runner
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.forward_cost = forward_cost
        self.max_requests = max_requests
        self._threads = threads
        self._jobs: list[_Job] = []
        self._in_flight: set[concurrent.futures.Future[Vectors]] = set()
        self._requests = self._inputs = self._forwards = 0

    def stats(self) -> EmbeddingStats:
        with self._cv:
            return EmbeddingStats(
                waiting=len(self._jobs),
                in_flight=len(self._in_flight),
                requests=self._requests,
                inputs=self._inputs,
                forwards=self._forwards,
            )

    async def embed(self, inputs: list[list[int]]) -> Vectors:
        """The vectors of `inputs` (non-empty token-id lists), computed in batches with other requests' inputs."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        future: concurrent.futures.Future[Vectors] = concurrent.futures.Future()
        with self._cv:
            if len(self._in_flight) >= self.max_requests:
                raise EngineOverloaded(
                    f"server is at capacity ({self.max_requests} requests in flight); retry later", retry_after_s=1
                )
            self._in_flight.add(future)
            self._jobs.append(_Job(inputs, future))
            self._cv.notify()
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, future: concurrent.futures.Future[Vectors]) -> None:
        with self._cv:
            self._in_flight.discard(future)

    def fail_in_flight(self, message: str) -> int:
        """Ends every request not answered yet with `EngineStopped(message)`; returns how many."""
        with self._cv:
            futures = list(self._in_flight)
        ended = 0
        for future in futures:
            try:
                future.set_exception(EngineStopped(message))
                ended += 1
            except concurrent.futures.InvalidStateError:  # answered or cancelled meanwhile
                pass
        return ended

    # The generation surface of the EngineClient protocol: an embedding model generates nothing.
    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        raise EngineError("an embedding model does not generate text")

    def abort(self, request_id: str) -> None:
        return None  # embeddings are cancelled through their awaitable

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # the thread's own setting
        while True:
            with self._cv:
                while not (self._jobs or self._calls or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    break
                jobs, self._jobs = self._jobs, []
                calls = self._take_calls()
            self._run_calls(calls)
            self._serve([job for job in jobs if job.future.set_running_or_notify_cancel()])
        with self._cv:
            left, self._jobs = self._jobs, []
        for job in left:
            job.future.cancel()
        self._cancel_calls()

    def _serve(self, jobs: list[_Job]) -> None:
        """Embeds the inputs of `jobs` together and answers each job."""
        if not jobs:
            return
        owners = [(j, k) for j, job in enumerate(jobs) for k in range(len(job.inputs))]
        flat = [jobs[j].inputs[k] for j, k in owners]
        results: list[list[np.ndarray | None]] = [[None] * len(job.inputs) for job in jobs]
        try:
            for batch in batches([len(ids) for ids in flat], self.max_rows, self.max_tokens, self.forward_cost):
                vectors = self.runner.embed([flat[i] for i in batch]).numpy()
                for row, index in enumerate(batch):
                    j, k = owners[index]
                    results[j][k] = vectors[row]
                with self._cv:
                    self._forwards += 1
                    self._inputs += len(batch)
        except Exception as exc:  # keep serving: these requests fail, the next ones get their turn
            logger.exception("embedding batch failed")
            for job in jobs:
                _settle(job.future, exception=EngineError(f"{type(exc).__name__}: {exc}"))
            return
        with self._cv:
            self._requests += len(jobs)
        for job, found in zip(jobs, results, strict=True):
            _settle(job.future, result=[v for v in found if v is not None])


def _settle(
    future: concurrent.futures.Future[Vectors], result: Vectors | None = None, exception: Exception | None = None
) -> None:
    """Answers a future unless `fail_in_flight` ended it first."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result or [])
    except concurrent.futures.InvalidStateError:
        pass
