"""The thread a model runs on: started and stopped from the event loop, and handed calls to run between its steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from transformers_openai.engine.errors import EngineStopped

T = TypeVar("T")

Call = tuple[Callable[[], Any], concurrent.futures.Future[Any]]


class EngineThread:
    """Base of the engines: one daemon thread runs `_run` until `stop`; the model is never used by two threads.

    Subclasses hand work to the thread under `_cv` and wake it with `_cv.notify()`; `_run` waits on `_cv`, takes the
    calls with `_take_calls` and runs them with `_run_calls` between its own units of work.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._calls: list[Call] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn()` on the engine thread between two steps (model work outside the batch, e.g. an alignment
        pass) and returns its result."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify()
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        raise NotImplementedError

    def _take_calls(self) -> list[Call]:
        """The calls handed over so far (call it holding `_cv`)."""
        calls, self._calls = self._calls, []
        return calls

    def _run_calls(self, calls: list[Call]) -> None:
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # the caller's failure, not the engine's
                    future.set_exception(exc)

    def _cancel_calls(self) -> None:
        """Called when the thread ends: calls it will never run are cancelled."""
        with self._cv:
            calls = self._take_calls()
        for _, future in calls:
            future.cancel()
