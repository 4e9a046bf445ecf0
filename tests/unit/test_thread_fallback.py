"""The engine's torch threads beside a busy neighbour: the policy drops to fewer threads when decode steps run far
slower than their usual time, probes the full count now and then and returns once it is fast again (a fake clock and
made-up step times: nothing here is timed); the engine thread applies its decisions and /metrics shows them."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from transformers_openai.engine.intra_op_threads import IntraOpThreads
from transformers_openai.engine.stats import StepStats, ThreadsReport
from transformers_openai.engine.thread_fallback import ThreadFallback
from transformers_openai.metrics import Metrics

USUAL = 0.040  # a decode step of one row on two threads, free cores
SLOW = 0.400  # the same step while another process spins on one of the two cores
ONE_THREAD = 0.055  # the step on one thread beside the neighbour


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def policy(clock: FakeClock) -> ThreadFallback:
    fallback = ThreadFallback(2, 1, clock)
    steps(fallback, USUAL, 8)
    return fallback


def steps(policy: ThreadFallback, seconds: float, count: int, rows: int = 1) -> list[int]:
    return [policy.after_step(rows, seconds) for _ in range(count)]


def fall_back(policy: ThreadFallback) -> None:
    assert steps(policy, SLOW, 3) == [2, 2, 1]


def test_steady_steps_keep_every_thread(policy: ThreadFallback) -> None:
    assert steps(policy, USUAL * 1.5, 50) == [2] * 50
    assert policy.fallbacks == 0


def test_a_few_slow_steps_in_a_row_drop_to_fewer_threads_and_say_so(
    policy: ThreadFallback, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="transformers_openai.engine.thread_fallback"):
        fall_back(policy)
    assert policy.threads == 1 and policy.fallbacks == 1
    assert "step 400 ms against a usual 40 ms on 2" in caplog.text
    assert "running on 1 thread until the cores are free" in caplog.text


def test_a_slow_step_now_and_then_is_not_a_neighbour(policy: ThreadFallback) -> None:
    for _ in range(10):
        assert steps(policy, SLOW, 2) + steps(policy, USUAL, 1) == [2, 2, 2]
    assert policy.fallbacks == 0


def test_nothing_is_judged_before_a_shape_has_a_usual_time(clock: FakeClock) -> None:
    fresh = ThreadFallback(2, 1, clock)
    assert steps(fresh, USUAL, 2) + steps(fresh, SLOW, 3) == [2] * 5


def test_shapes_and_prefills_are_not_compared_with_one_row_decodes(policy: ThreadFallback) -> None:
    assert steps(policy, SLOW, 5, rows=0) == [2] * 5  # steps that prefilled
    assert steps(policy, SLOW, 5, rows=16) == [2] * 5  # sixteen rows: a shape of its own, learning its usual time
    assert steps(policy, SLOW, 5, rows=12) == [2] * 5  # the same power-of-two bucket as sixteen
    assert policy.fallbacks == 0


def test_the_full_count_is_probed_every_few_seconds_while_reduced(policy: ThreadFallback, clock: FakeClock) -> None:
    fall_back(policy)
    assert steps(policy, ONE_THREAD, 10) == [1] * 10
    clock.now += 2.0
    assert steps(policy, ONE_THREAD, 1) == [2]  # the next step probes two threads


def test_a_probe_beside_the_neighbour_costs_one_step_and_waits_longer_next_time(
    policy: ThreadFallback, clock: FakeClock
) -> None:
    fall_back(policy)
    steps(policy, ONE_THREAD, 10)
    clock.now += 2.0
    steps(policy, ONE_THREAD, 1)
    assert steps(policy, SLOW, 1) == [1]  # the probe step was slower than one thread is now: back at once
    clock.now += 2.0
    assert steps(policy, ONE_THREAD, 3) == [1, 1, 1]  # the wait doubled after a failed probe
    clock.now += 2.0
    assert steps(policy, ONE_THREAD, 1) == [2]
    assert steps(policy, SLOW, 1) == [1]
    clock.now += 4.0  # the wait stops growing at probe_most_s
    assert steps(policy, ONE_THREAD, 1) == [2]
    assert policy.fallbacks == 1


def test_a_probe_step_of_seconds_makes_the_next_wait_longer(policy: ThreadFallback, clock: FakeClock) -> None:
    fall_back(policy)
    steps(policy, ONE_THREAD, 10)
    clock.now += 2.0
    steps(policy, ONE_THREAD, 1)
    assert steps(policy, 2.5, 1) == [1]  # a probe step of 2.5 s: the next probe waits three times that
    clock.now += 7.0
    assert steps(policy, ONE_THREAD, 1) == [1]
    clock.now += 1.0
    assert steps(policy, ONE_THREAD, 1) == [2]


def test_the_full_count_returns_once_it_beats_the_reduced_one_again(
    policy: ThreadFallback, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    fall_back(policy)
    steps(policy, ONE_THREAD, 10)
    clock.now += 2.0
    steps(policy, ONE_THREAD, 1)
    with caplog.at_level(logging.WARNING, logger="transformers_openai.engine.thread_fallback"):
        assert steps(policy, USUAL, 3) == [2, 2, 2]  # three probe steps faster than one thread
    assert "back to 2" in caplog.text
    assert steps(policy, USUAL, 20) == [2] * 20
    fall_back(policy)  # a neighbour that comes back is noticed again
    assert policy.fallbacks == 2


def test_a_lucky_probe_beside_the_neighbour_is_taken_back_within_seconds(
    policy: ThreadFallback, clock: FakeClock
) -> None:
    """Three fast probe steps while the neighbour is still there bring two threads back; their steps then take twice
    their usual time, which is below the slow factor and never called slow. One thread is tried again after the
    probe interval, not after `explore_every_s`, and wins."""
    fall_back(policy)
    steps(policy, ONE_THREAD, 10)
    clock.now += 2.0
    steps(policy, ONE_THREAD, 1)
    assert steps(policy, USUAL, 3) == [2, 2, 2]  # the lucky probe
    assert steps(policy, 2 * USUAL, 10) == [2] * 10  # twice as slow: not slow enough to fall back on its own
    clock.now += 2.0
    assert steps(policy, 2 * USUAL, 1) == [1]  # time to try one thread again
    assert steps(policy, ONE_THREAD, 3) == [1, 1, 1]  # faster than two threads are now: one it is
    assert policy.fallbacks == 2


def test_after_a_return_the_tries_of_fewer_threads_space_out_on_free_cores(
    policy: ThreadFallback, clock: FakeClock
) -> None:
    fall_back(policy)
    steps(policy, ONE_THREAD, 10)
    clock.now += 2.0
    steps(policy, ONE_THREAD, 1)
    assert steps(policy, USUAL, 3) == [2, 2, 2]  # the cores are free again
    waits = []
    for _ in range(6):
        start = clock.now
        while steps(policy, USUAL, 1) == [2]:
            clock.now += 0.5
        waits.append(clock.now - start)
        assert steps(policy, 2 * ONE_THREAD, 1) == [2]  # one thread slower than two: back at once, one step lost
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.fallbacks == 1


def test_one_thread_faster_than_two_on_free_cores_keeps_one(policy: ThreadFallback, clock: FakeClock) -> None:
    """Like with like: the probe compares two threads now with one thread now, not with two threads before."""
    fall_back(policy)
    steps(policy, 0.030, 10)  # one thread is now faster than two ever were
    clock.now += 2.0
    steps(policy, 0.030, 1)
    assert steps(policy, USUAL, 1) == [1]


def test_cores_busy_from_the_start_are_found_by_trying_fewer_threads_now_and_then(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    busy = ThreadFallback(2, 1, clock, explore_every_s=30.0)
    assert steps(busy, SLOW, 10) == [2] * 10  # slow from the start: slow is the usual time
    clock.now += 30.0
    assert steps(busy, SLOW, 1) == [1]  # time to try one thread
    with caplog.at_level(logging.WARNING, logger="transformers_openai.engine.thread_fallback"):
        assert steps(busy, ONE_THREAD, 3) == [1, 1, 1]  # three steps faster than two threads' usual: one it is
    assert busy.fallbacks == 1
    assert "steps on 1 thread take 55 ms against a usual 400 ms on 2" in caplog.text


def test_trying_fewer_threads_on_free_cores_costs_a_step(policy: ThreadFallback, clock: FakeClock) -> None:
    clock.now += 30.0
    assert steps(policy, USUAL, 1) == [1]
    assert steps(policy, ONE_THREAD, 1) == [2]  # slower than two threads are: back at once
    assert steps(policy, USUAL, 20) == [2] * 20  # and not tried again for a while
    clock.now += 30.0
    assert steps(policy, USUAL, 1) == [1]
    assert policy.fallbacks == 0


def test_a_new_shape_while_trying_a_count_ends_the_try(policy: ThreadFallback, clock: FakeClock) -> None:
    clock.now += 30.0
    assert steps(policy, USUAL, 1) == [1]
    assert steps(policy, USUAL, 1, rows=16) == [2]  # no usual time on two threads for sixteen rows yet
    fall_back(policy)
    steps(policy, ONE_THREAD, 10)
    clock.now += 4.0
    assert steps(policy, ONE_THREAD, 1) == [2]
    assert steps(policy, USUAL, 1, rows=32) == [1]  # a shape neither count knows: not judged on two threads


def test_the_reduced_count_must_be_fewer_and_at_least_one() -> None:
    for reduced in (0, 2, 3):
        with pytest.raises(ValueError, match="reduced threads"):
            ThreadFallback(2, reduced)


def test_the_engine_thread_takes_the_count_the_policy_decides(clock: FakeClock) -> None:
    before = torch.get_num_threads()
    seen: list[tuple[int, ThreadsReport]] = []

    def engine_thread() -> None:
        threads = IntraOpThreads(2, ThreadFallback(2, 1, clock))
        threads.apply()
        for _ in range(8):
            threads.after_step(1, USUAL)
        seen.append((torch.get_num_threads(), threads.report))
        for _ in range(3):
            report = threads.after_step(1, SLOW)
        seen.append((torch.get_num_threads(), report))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == [(2, ThreadsReport(2, 0)), (1, ThreadsReport(1, 1))]
    assert torch.get_num_threads() == before  # the setting is the engine thread's own


def test_metrics_show_the_threads_and_count_the_fallbacks() -> None:
    metrics = Metrics("m")
    assert 'transformers_openai:engine_thread_fallbacks_total{model_name="m"} 0.0' in metrics.render().decode()

    def step(report: ThreadsReport) -> None:
        metrics.on_step(StepStats(0, 0, 1, 1, 1, 0, 1, [], threads=report))

    step(ThreadsReport(2, 0))
    step(ThreadsReport(1, 1))
    step(ThreadsReport(1, 1))
    text = metrics.render().decode()
    assert 'transformers_openai:engine_torch_threads{model_name="m"} 1.0' in text
    assert 'transformers_openai:engine_thread_fallbacks_total{model_name="m"} 1.0' in text
