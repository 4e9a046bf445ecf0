"""The embedding engine: inputs of concurrent requests share forwards, sorted by length, within the limits."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from transformers_openai.engine.embedding_engine import EmbeddingEngine, batches
from transformers_openai.engine.errors import EngineError, EngineOverloaded, EngineStopped


class CountingRunner:
    """A vector per input that says its length and first token; the first forward waits for `release`."""

    def __init__(self) -> None:
        self.forwards: list[list[int]] = []  # the lengths of each forward's inputs
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        self.entered.set()
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("boom")
        self.forwards.append([len(ids) for ids in inputs])
        return torch.tensor([[float(len(ids)), float(ids[0])] for ids in inputs])


def test_batches_sort_by_length_and_respect_both_limits() -> None:
    lengths = [5, 1, 3, 8, 2, 100]
    got = list(batches(lengths, max_rows=2, max_tokens=16))
    assert [[lengths[i] for i in batch] for batch in got] == [[1, 2], [3, 5], [8], [100]]
    assert sorted(i for batch in got for i in batch) == list(range(len(lengths)))


def test_batches_keep_similar_lengths_together() -> None:
    lengths = [130, *[50] * 10, 135, 30]
    got = [[lengths[i] for i in batch] for batch in batches(lengths, max_rows=64, max_tokens=4096, forward_cost=32)]
    assert got == [[30, *[50] * 10], [130, 135]]  # padding 30 to 50 costs less than a forward; 50 to 130 does not
    alone = batches(lengths, max_rows=64, max_tokens=4096, forward_cost=0)  # forwards free: no padding at all
    assert all(len({lengths[i] for i in batch}) == 1 for batch in alone)
    full = batches(lengths, max_rows=64, max_tokens=4096, forward_cost=10_000)  # forwards dear: one batch
    assert len(full) == 1


async def _engine(runner: CountingRunner, **limits: int) -> EmbeddingEngine:
    engine = EmbeddingEngine(
        runner,
        **{"max_rows": 64, "max_tokens": 4096, "max_requests": 64, "threads": 1, "forward_cost": 10_000, **limits},
    )
    await engine.start()
    return engine


async def test_concurrent_requests_share_one_forward() -> None:
    runner = CountingRunner()
    engine = await _engine(runner)
    try:
        first = asyncio.ensure_future(engine.embed([[7]]))
        await asyncio.to_thread(runner.entered.wait, 10)  # the engine is busy with the first request
        rest = [asyncio.ensure_future(engine.embed([[i] * (1 + i % 4), [i, i]])) for i in range(10)]
        await asyncio.sleep(0.05)
        assert engine.stats().in_flight == 11
        runner.release.set()
        results = await asyncio.gather(first, *rest)
    finally:
        await engine.stop()
    assert len(runner.forwards) == 2  # 21 inputs, 11 requests: the 10 that waited went in one forward
    assert runner.forwards[1] == sorted(runner.forwards[1])
    for i, vectors in enumerate(results[1:]):  # each request gets its own vectors back, in its order
        assert [v.tolist() for v in vectors] == [[1 + i % 4, i], [2, i]]
    assert engine.stats().forwards == 2 and engine.stats().in_flight == 0


async def test_full_engine_answers_overloaded() -> None:
    runner = CountingRunner()
    engine = await _engine(runner, max_requests=2)
    try:
        busy = [asyncio.ensure_future(engine.embed([[1]])) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded):
            await engine.embed([[1]])
        runner.release.set()
        await asyncio.gather(*busy)
    finally:
        await engine.stop()


async def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on() -> None:
    runner = CountingRunner()
    runner.fail = True
    runner.release.set()
    engine = await _engine(runner)
    try:
        with pytest.raises(EngineError, match="boom"):
            await engine.embed([[1, 2]])
        runner.fail = False
        assert len(await engine.embed([[1, 2]])) == 1
    finally:
        await engine.stop()


async def test_fail_in_flight_ends_waiting_requests() -> None:
    runner = CountingRunner()
    engine = await _engine(runner)
    try:
        waiting = asyncio.ensure_future(engine.embed([[1]]))
        await asyncio.to_thread(runner.entered.wait, 10)
        assert engine.fail_in_flight("shutting down") == 1
        with pytest.raises(EngineStopped, match="shutting down"):
            await waiting
        assert engine.stats().in_flight == 0
    finally:
        runner.release.set()
        await engine.stop()


async def test_a_cancelled_request_costs_no_forward() -> None:
    runner = CountingRunner()
    engine = await _engine(runner)
    try:
        first = asyncio.ensure_future(engine.embed([[1]]))
        await asyncio.to_thread(runner.entered.wait, 10)
        gone = asyncio.ensure_future(engine.embed([[2, 2, 2]]))
        await asyncio.sleep(0.01)
        assert engine.stats().in_flight == 2 and engine.stats().waiting == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.sleep(0)  # the cancellation reaches the engine's future in a loop callback
        assert engine.stats().in_flight == 1
        runner.release.set()
        await first
        await engine.embed([[3]])
    finally:
        await engine.stop()
    assert all(3 not in lengths for lengths in runner.forwards)
