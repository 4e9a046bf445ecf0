"""The asyncio front of the engine: submit, stream outputs, abort. Runs the core on its own thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.errors import DuplicateRequestId, EngineOverloaded, EngineStopped
from transformers_openai.engine.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    rows_in_use: int
    in_flight: int


class AsyncEngine:
    """Thread-safe bridge between the event loop and the `EngineCore` thread.

    Admission is decided at once on the event loop (`submit` raises `EngineOverloaded`); outputs
    come back with `loop.call_soon_threadsafe` into a per-request queue, one hop per engine step.
    """

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, EngineRequest | str]] = []
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def stats(self) -> EngineStats:
        scheduler = self._core.scheduler
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            rows_in_use=self._core.runner.rows_in_use(),
            in_flight=len(self._streams),
        )

    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Admits all the requests or none of them (raises `EngineOverloaded`). Call on the event loop."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        capacity = self._core.scheduler.capacity
        if len(self._streams) + len(requests) > capacity:
            raise EngineOverloaded(
                f"server is at capacity ({capacity} requests running or queued); retry later", retry_after_s=1
            )
        ids = [request.request_id for request in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise DuplicateRequestId(f"a request with id {ids[0]} is already in flight")
        streams = []
        for request in requests:
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._streams[request.request_id] = queue
            streams.append(self._stream(request.request_id, queue))
        with self._cv:
            self._inbox.extend(("add", request) for request in requests)
            self._cv.notify()
        return streams

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return self.submit([request])[0]

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its row is freed at the next step boundary. Idempotent."""
        if self._streams.pop(request_id, None) is None:
            return
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    async def _stream(self, request_id: str, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is None:
                continue  # aborted meanwhile
            if output.finished:
                del self._streams[output.request_id]
            queue.put_nowait(output)

    def _run(self) -> None:
        core = self._core
        while True:
            with self._cv:
                while not self._inbox and not core.has_work() and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            outputs: list[RequestOutput] = []
            for kind, item in inbox:
                if kind == "add":
                    assert isinstance(item, EngineRequest)
                    core.add(item)
                else:
                    assert isinstance(item, str)
                    core.abort(item)
            try:
                outputs.extend(core.step())
            except Exception as exc:  # keep serving: fail what was in flight and go on
                logger.exception("engine step failed")
                outputs.extend(core.fail_all(exc))
            if outputs and self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
        failed = self._core.fail_all(EngineStopped("the engine stopped"))
        if failed and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, failed)
