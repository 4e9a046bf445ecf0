"""The engine thread's first step sets its torch threads, whatever the thread had; a model loads on a thread that
ends, and torch work on other pooled threads runs on one torch thread, so no OpenMP team stays beside the engine's."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from transformers_openai.engine.intra_op_threads import IntraOpThreads, in_passing_thread, one_torch_thread


def test_the_first_step_sets_the_threads_and_later_ones_keep_them() -> None:
    before = torch.get_num_threads()
    threads = IntraOpThreads(most=2)
    try:
        torch.set_num_threads(1)
        threads.fit(1)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)  # not the engine's doing: left as it is
        threads.fit(300)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_passing_thread_returns_the_result_and_ends() -> None:
    seen: list[threading.Thread] = []

    def load() -> int:
        seen.append(threading.current_thread())
        return 42

    assert asyncio.run(in_passing_thread(load)) == 42
    seen[0].join(timeout=5)
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()


def test_a_passing_thread_raises_what_the_function_raised() -> None:
    def load() -> int:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(in_passing_thread(load))


def test_work_off_the_engine_thread_runs_on_one_torch_thread() -> None:
    seen: list[int] = []

    def features(scale: float, *, offset: float) -> float:
        seen.append(torch.get_num_threads())
        return float(torch.ones(4).mul(scale).add(offset).sum())

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what a fresh thread would take up
    try:
        with ThreadPoolExecutor(1) as pool:  # a pooled thread, as asyncio.to_thread's
            assert pool.submit(features, 2.0, offset=1.0).result() == 12.0
            assert pool.submit(one_torch_thread(features), 2.0, offset=1.0).result() == 12.0
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 1]
