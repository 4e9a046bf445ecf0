"""The engine thread's first step sets its torch threads, whatever the thread had; a model loads on a thread that
ends, so it leaves no OpenMP team beside the engine's."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from transformers_openai.engine.intra_op_threads import IntraOpThreads, in_passing_thread


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
