"""Scheduler: FIFO admission within the running limit and the prefill-token budget; removal; capacity."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from transformers_openai.engine.request import EngineRequest
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.sequence import Sequence


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def make(tokenizer):
    def build(request_id: str, prompt_len: int = 4) -> Sequence:
        request = EngineRequest(request_id, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=4))
        return Sequence(request, tokenizer, frozenset({tokenizer.eos_token_id}), max_total_len=64)

    return build


def admit(scheduler: Scheduler) -> list[str]:
    """Plans a step and completes every planned prefill chunk, as the engine core does with a runner."""
    started = []
    for seq, take in scheduler.prefill_plan():
        seq.prefill.done += take
        if not seq.prefill.remaining:
            scheduler.start(seq)
            started.append(seq.request_id)
    return started


def test_fifo_admission_within_max_running(make) -> None:
    scheduler = Scheduler(max_running=2, max_waiting=8)
    for name in "abcde":
        scheduler.add(make(name))
    assert admit(scheduler) == ["a", "b"]
    assert admit(scheduler) == []
    assert list(scheduler.running) == ["a", "b"]
    assert list(scheduler.waiting) == ["c", "d", "e"]
    scheduler.remove("a")
    assert admit(scheduler) == ["c"]
    scheduler.remove("b")
    scheduler.remove("c")
    assert admit(scheduler) == ["d", "e"]


def test_prefill_budget_splits_prompts_into_chunks_in_order(make) -> None:
    scheduler = Scheduler(max_running=8, max_waiting=8, max_prefill_tokens=10)
    for name, n in [("a", 6), ("b", 6), ("c", 3), ("d", 1)]:
        scheduler.add(make(name, n))
    plan = scheduler.prefill_plan()
    assert [(seq.request_id, take) for seq, take in plan] == [("a", 6), ("b", 4)]  # b starts, c waits its turn
    for seq, take in plan:
        seq.prefill.done += take
    scheduler.start(plan[0][0])
    assert [(seq.request_id, take) for seq, take in scheduler.prefill_plan()] == [("b", 2), ("c", 3), ("d", 1)]


def test_a_prompt_longer_than_the_budget_is_prefilled_over_several_steps(make) -> None:
    scheduler = Scheduler(max_running=4, max_waiting=4, max_prefill_tokens=10)
    scheduler.add(make("big", 25))
    scheduler.add(make("small", 1))
    assert admit(scheduler) == []  # 10 of 25
    assert admit(scheduler) == []  # 20 of 25
    assert admit(scheduler) == ["big", "small"]  # the last 5, then the small one fits the rest of the budget
    assert list(scheduler.running) == ["big", "small"] and not scheduler.prefilling


def test_requests_being_prefilled_count_toward_max_running(make) -> None:
    scheduler = Scheduler(max_running=1, max_waiting=4, max_prefill_tokens=4)
    scheduler.add(make("long", 10))
    scheduler.add(make("next", 2))
    assert [seq.request_id for seq, _ in scheduler.prefill_plan()] == ["long"]
    assert scheduler.remove("long") is not None  # aborted mid-prefill
    assert [seq.request_id for seq, _ in scheduler.prefill_plan()] == ["next"]


def test_remove_from_waiting_and_running(make) -> None:
    scheduler = Scheduler(max_running=1, max_waiting=4)
    a, b, c = make("a"), make("b"), make("c")
    for seq in (a, b, c):
        scheduler.add(seq)
    assert admit(scheduler) == ["a"]
    assert scheduler.remove("b") is b
    assert scheduler.remove("b") is None
    assert scheduler.remove("a") is a
    assert scheduler.remove("unknown") is None
    assert admit(scheduler) == ["c"]
    assert scheduler.remove("c") is c
    assert not scheduler.has_work()


def test_has_work_and_capacity(make) -> None:
    scheduler = Scheduler(max_running=3, max_waiting=5)
    assert scheduler.capacity == 8
    assert not scheduler.has_work()
    scheduler.add(make("a"))
    assert scheduler.has_work()
    admit(scheduler)
    assert scheduler.has_work()
    scheduler.remove("a")
    assert not scheduler.has_work()


def test_a_continuation_goes_to_the_head_of_the_queue(tokenizer) -> None:
    scheduler = Scheduler(max_running=1, max_waiting=4)

    def seq(request_id: str, continuation: bool = False) -> Sequence:
        request = EngineRequest(request_id, [100, 101], SamplingParams(max_tokens=4), continuation=continuation)
        return Sequence(request, tokenizer, frozenset({tokenizer.eos_token_id}), max_total_len=64)

    scheduler.add(seq("running"))
    assert admit(scheduler) == ["running"]
    for s in (seq("first"), seq("second"), seq("window-2", continuation=True)):
        scheduler.add(s)
    assert list(scheduler.waiting) == ["window-2", "first", "second"]


def test_an_encoder_overhead_counts_against_the_prefill_budget(make) -> None:
    """Windows of speech (1-token prompts, a 1500-position encoder pass each): two fit a 4096 budget per step."""
    scheduler = Scheduler(max_running=16, max_waiting=16, max_prefill_tokens=4096)
    for name in "abcde":
        seq = make(name, prompt_len=1)
        seq.prefill.overhead = 1500
        scheduler.add(seq)
    assert admit(scheduler) == ["a", "b"]
    assert admit(scheduler) == ["c", "d"]
    assert admit(scheduler) == ["e"]


def test_an_overhead_over_the_whole_budget_still_makes_progress(make) -> None:
    scheduler = Scheduler(max_running=4, max_waiting=4, max_prefill_tokens=100)
    for name in "ab":
        seq = make(name, prompt_len=3)
        seq.prefill.overhead = 1500
        scheduler.add(seq)
    assert admit(scheduler) == ["a"]
    assert admit(scheduler) == ["b"]


@pytest.fixture
def make_prioritized(tokenizer):
    def build(request_id: str, priority: int, continuation: bool = False) -> Sequence:
        params = SamplingParams(max_tokens=4)
        request = EngineRequest(request_id, [100, 101], params, continuation=continuation, priority=priority)
        return Sequence(request, tokenizer, frozenset({tokenizer.eos_token_id}), max_total_len=64)

    return build


def test_waiting_requests_are_admitted_by_priority_then_arrival(make_prioritized) -> None:
    scheduler = Scheduler(max_running=1, max_waiting=8)
    for name, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        scheduler.add(make_prioritized(name, priority))
    assert list(scheduler.waiting) == ["d", "b", "e", "a", "c"]
    assert admit(scheduler) == ["d"]


def test_continuations_and_preempted_go_first_within_their_priority(make_prioritized) -> None:
    scheduler = Scheduler(max_running=1, max_waiting=8)
    for name, priority in [("a", 0), ("b", 2), ("c", 2)]:
        scheduler.add(make_prioritized(name, priority))
    scheduler.add(make_prioritized("next", 2, continuation=True))
    assert list(scheduler.waiting) == ["a", "next", "b", "c"]
    late = make_prioritized("late", 1)
    scheduler.requeue(late)
    assert list(scheduler.waiting) == ["a", "late", "next", "b", "c"]


def test_default_priority_keeps_fifo_and_continuations_first(make_prioritized) -> None:
    scheduler = Scheduler(max_running=1, max_waiting=8)
    for name in "abc":
        scheduler.add(make_prioritized(name, 0))
    scheduler.add(make_prioritized("next", 0, continuation=True))
    assert list(scheduler.waiting) == ["next", "a", "b", "c"]


def test_requests_starting_together_share_a_priority(make_prioritized) -> None:
    scheduler = Scheduler(max_running=8, max_waiting=8)
    for name, priority in [("b1", 9), ("b2", 9), ("i1", 0), ("i2", 0)]:
        scheduler.add(make_prioritized(name, priority))
    assert admit(scheduler) == ["i1", "i2"]  # the batch lines wait a step rather than lengthen this prefill
    assert admit(scheduler) == ["b1", "b2"]
