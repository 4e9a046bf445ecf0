"""The engine thread sets its torch threads when it starts, whatever a fresh thread takes up; a model loads on a thread
that ends, and torch work on other pooled threads runs on one torch thread: no OpenMP team stays beside the engine's."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from transformers_openai.engine.intra_op_threads import IntraOpThreads, in_passing_thread, one_torch_thread


def test_the_engine_thread_gets_its_threads_whatever_torch_gives_a_fresh_thread() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []

    def engine_thread() -> None:
        IntraOpThreads(most=2).apply()
        torch.ones(4).sum()
        seen.append(torch.get_num_threads())

    torch.set_num_threads(1)  # what a fresh thread takes up (a transcription's worker set it last)
    try:
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [2]


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
