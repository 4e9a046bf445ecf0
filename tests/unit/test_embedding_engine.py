"""The embedding engine: inputs of concurrent requests share forwards, sorted by length, within the limits."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from transformers_openai.engine.embedding_engine import Embedder, EmbeddingEngine, batches, cut_pieces
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


async def _engine(runner: Embedder, **limits: int) -> EmbeddingEngine:
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


def test_pieces_cut_a_request_at_one_forward_each() -> None:
    lengths = [4, 1, 4, 2, 4, 30, 4]
    got = [[lengths[i] for i in piece] for piece in cut_pieces(lengths, max_rows=3, max_tokens=10)]
    assert got == [[1, 2], [4, 4], [4, 4], [30]]  # 3 rows of 4 pad to 12 tokens; 30 is over the bound: alone
    assert sorted(i for piece in cut_pieces(lengths, 3, 10) for i in piece) == list(range(len(lengths)))
    assert cut_pieces([5] * 7, max_rows=3, max_tokens=1000) == [[0, 1, 2], [3, 4, 5], [6]]


class GatedRunner:
    """Each forward waits for a permit (`step`), so a test decides how many forwards run and when."""

    def __init__(self) -> None:
        self.forwards: list[list[int]] = []  # the first token of each input of each forward
        self._permits = threading.Semaphore(0)
        self._entered = threading.Semaphore(0)

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        self._entered.release()
        if not self._permits.acquire(timeout=10):
            raise RuntimeError("no permit")
        self.forwards.append([ids[0] for ids in inputs])
        return torch.tensor([[float(ids[0]), float(len(ids))] for ids in inputs])

    async def entered(self) -> None:
        """Waits until a forward has started (and waits for its permit)."""
        assert await asyncio.to_thread(self._entered.acquire, True, 10)

    def step(self) -> None:
        self._permits.release()


BIG = 7  # the first token of the big request's inputs
SMALL = 3


async def test_an_abandoned_request_stops_at_its_running_piece() -> None:
    runner = GatedRunner()
    engine = await _engine(runner, max_rows=64, max_tokens=20)  # 2 inputs of 10 tokens a piece
    try:
        big = asyncio.ensure_future(engine.embed([[BIG] * 10 for _ in range(40)]))  # 20 pieces
        await runner.entered()  # its first piece is in a forward
        big.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await big
        small = asyncio.ensure_future(engine.embed([[SMALL, 1]]))
        runner.step()  # the big request's running forward ends
        await runner.entered()
        runner.step()
        assert [v.tolist() for v in await small] == [[SMALL, 2]]
        stats = engine.stats()
    finally:
        for _ in range(4):
            runner.step()
        await engine.stop()
    # The big request ran one piece; its 19 others were dropped, none cost a forward.
    assert runner.forwards == [[BIG, BIG], [SMALL]]
    assert stats.dropped == 38 and stats.forwards == 2 and stats.in_flight == 0


async def test_a_later_request_runs_between_the_pieces_of_a_big_one() -> None:
    runner = GatedRunner()
    engine = await _engine(runner, max_rows=64, max_tokens=20)
    try:
        big = asyncio.ensure_future(engine.embed([[BIG + i] * 10 for i in range(12)]))  # 6 pieces of 2 inputs
        await runner.entered()
        small = asyncio.ensure_future(engine.embed([[SMALL, 1]]))
        await asyncio.sleep(0.01)  # queued while the big request's first forward waits for its permit
        for _ in range(7):
            runner.step()
        vectors, _ = await asyncio.gather(big, small)
    finally:
        await engine.stop()
    # The small request waited for the big one's running piece only, then shared the next round with its second.
    assert runner.forwards == [[BIG, BIG + 1], [SMALL], *[[BIG + i, BIG + i + 1] for i in range(2, 12, 2)]]
    assert [v.tolist() for v in vectors] == [[BIG + i, 10] for i in range(12)]  # in the request's order
