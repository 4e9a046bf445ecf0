"""The engine thread's torch threads on a CPU, and keeping its OpenMP team the only one of the process.

OpenMP (libgomp, torch's CPU threading) keeps a team of worker threads for every thread that has run a parallel
region, for as long as that thread lives. Once the teams of a process hold more threads than the machine has cores,
every worker stops waiting for the next region by spinning and sleeps at once, so each parallel region pays a wake-up:
on the 2-core machine a small elementwise op took 53 us instead of 5, and SmolLM2's batch-1 decode step 51-60 ms
instead of 39-43, when the model had been loaded on a pooled thread that lived on beside the engine's
(`loadtest step-interference` sets up that condition). So the model is loaded on a thread that ends
(`in_passing_thread`) and torch work on other pooled threads (audio features, word alignment) runs on one torch
thread, which needs no team (`one_torch_thread`). Over HTTP at one stream with two threads the server's decode step
then took 31 ms where it had taken 47-50.

How many threads: `cpu_threads` caps torch's default at the CPUs the process may really use (engine/usable_cpus.py),
and `engine_threads` adds the fallback to fewer while another process takes a core (engine/thread_fallback.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import torch

from transformers_openai.engine.stats import ThreadsReport
from transformers_openai.engine.thread_fallback import ThreadFallback
from transformers_openai.engine.usable_cpus import usable_cpus

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")


class IntraOpThreads:
    """The engine thread's torch threads: `apply` on that thread when it starts (the setting is per thread).

    Every step uses all of them, a single decode row too: with the engine's team the only OpenMP team of the process,
    SmolLM2 at one stream gave 23.9 tokens/s on two threads against 17.8 on one (2-core machine, over HTTP, one run
    each, the same hour). Before, beside a loader thread's team, one thread had been the faster for steps of a token
    or two.

    With `fallback`, the steps run on fewer threads while another process takes a core (engine/thread_fallback.py):
    `after_step` hands it each step's time and sets the count it decides on the engine thread.

    Args:
        most: the threads the steps use (--torch-threads, or `cpu_threads`).
        fallback: the policy that lowers and restores the count; None keeps `most` throughout.
    """

    def __init__(self, most: int, fallback: ThreadFallback | None = None) -> None:
        self.most = most
        self._fallback = fallback
        self.report = ThreadsReport(most, 0)

    def apply(self) -> None:
        torch.get_num_threads()  # torch's own first-use setting of this thread, done before ours, not after
        torch.set_num_threads(self.most)

    def after_step(self, decode_rows: int, seconds: float) -> ThreadsReport:
        """Called on the engine thread after each step with the rows it decoded (0 for a step that prefilled) and
        its seconds; sets the threads of the next step and returns the count and the fallbacks so far."""
        if self._fallback is not None:
            threads = self._fallback.after_step(decode_rows, seconds)
            if threads != self.report.threads:
                torch.set_num_threads(threads)
                self.report = ThreadsReport(threads, self._fallback.fallbacks)
        return self.report


def cpu_threads(requested: int | None) -> int:
    """The torch threads of a CPU server: --torch-threads when given, else torch's default (which follows
    OMP_NUM_THREADS) capped at the CPUs the process may use (engine/usable_cpus.py); the choice is logged."""
    if requested:
        return requested
    cpus = usable_cpus()
    default = torch.get_num_threads()
    chosen = min(default, cpus.count)
    logger.info("torch threads: %d (%s; torch's default %d)", chosen, cpus.describe(), default)
    return chosen


def engine_threads(most: int, fallback: bool) -> IntraOpThreads:
    """The engine thread's threads on a CPU; with `fallback` and several threads, halved while another process takes
    a core."""
    policy = ThreadFallback(most, max(1, most // 2)) if fallback and most > 1 else None
    return IntraOpThreads(most, policy)


async def in_passing_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a worker thread of its own that ends once `fn` returns, so no OpenMP team of its outlives it (a
    pooled thread, as `asyncio.to_thread`'s, keeps its team for good)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="loader")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)
    finally:
        pool.shutdown(wait=False)  # the thread exits after its one call


def one_torch_thread(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn` run with one torch thread on the calling thread: for torch work on a pooled thread other than the
    engine's, which would otherwise keep an OpenMP team beside the engine's for good."""

    @functools.wraps(fn)
    def on_one_thread(*args: P.args, **kwargs: P.kwargs) -> T:
        torch.set_num_threads(1)
        return fn(*args, **kwargs)

    return on_one_thread
