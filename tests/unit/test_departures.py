"""Retry-After from the recent departure rate: longer queues and slower servers ask clients to wait longer."""

from __future__ import annotations

from transformers_openai.engine.departures import Departures


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unknown_rate_answers_the_minimum() -> None:
    departures = Departures(clock=Clock())
    assert departures.rate_per_s() is None and departures.retry_after_s(50) == 1
    departures.record()
    assert departures.retry_after_s(50) == 1


def test_wait_grows_with_the_queue_and_shrinks_with_the_rate() -> None:
    clock = Clock()
    departures = Departures(clock=clock)
    for _ in range(5):  # one departure every 2 s
        departures.record()
        clock.now += 2.0
    clock.now -= 2.0
    assert departures.rate_per_s() == 0.5
    assert [departures.retry_after_s(ahead) for ahead in (1, 3, 10, 1000)] == [2, 6, 20, 60]
    for _ in range(64):  # then a burst: 10 per second
        clock.now += 0.1
        departures.record()
    assert departures.retry_after_s(3) == 1 and departures.retry_after_s(30) == 3
