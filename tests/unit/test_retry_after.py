"""A 429's Retry-After follows the rows' remaining tokens at the recent step time, however long the server idled."""

from __future__ import annotations

from transformers_openai.engine.retry_after import RetryAfter


def timed(step_s: float, steps: int = 10) -> RetryAfter:
    estimate = RetryAfter()
    for _ in range(steps):
        estimate.record_step(step_s)
    return estimate


def test_nothing_timed_yet_says_the_least() -> None:
    assert RetryAfter().seconds(1, rows=4, running=[(0, 500)] * 4, waiting=[]) == RetryAfter.MIN_S


def test_four_rows_leaving_together_free_room_when_their_tokens_are_done() -> None:
    # 4 rows with 100 tokens to go at 50 ms a step: the first leaves in 5 s, and so do the other three.
    estimate = timed(0.05)
    assert estimate.seconds(1, rows=4, running=[(20, 100)] * 4, waiting=[]) == 5
    assert estimate.seconds(4, rows=4, running=[(20, 100)] * 4, waiting=[]) == 5


def test_waiting_requests_take_the_rows_that_come_free() -> None:
    # Rows leave after 10 and 20 steps; the waiting request starts at step 10 and leaves at 10 + 1 + 30.
    estimate = timed(1.0)
    running = [(0, 10), (0, 20)]
    assert [estimate.seconds(k, rows=2, running=running, waiting=[30]) for k in (1, 2, 3)] == [10, 20, 41]


def test_answers_that_end_early_bound_the_estimate() -> None:
    estimate = timed(0.1)
    for _ in range(10):
        estimate.record_answer(40)  # answers stop at about 40 tokens, far below their limit of 2000
    assert estimate.seconds(1, rows=1, running=[(10, 1990)], waiting=[]) == 3  # 30 more steps, not 1990


def test_within_bounds() -> None:
    estimate = timed(1.0)
    assert estimate.seconds(1, rows=1, running=[(0, 10_000)], waiting=[]) == RetryAfter.MAX_S
    assert estimate.seconds(1, rows=1, running=[(0, 0)], waiting=[]) == RetryAfter.MIN_S
