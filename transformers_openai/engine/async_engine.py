"""The asyncio front of the engine: submit, stream outputs, abort. Runs the core on its own thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.engine_thread import EngineThread
from transformers_openai.engine.errors import DuplicateRequestId, EngineOverloaded, EngineStopped, TooManySequences
from transformers_openai.engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput
from transformers_openai.engine.retry_after import RetryAfter

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Outputs one request may have waiting for its consumer. A consumer that is this far behind (a client
# that stopped reading) is ended and its row freed, so memory per request stays bounded.
DEFAULT_MAX_PENDING_OUTPUTS = 2048


@dataclass(frozen=True)
class FlowControl:
    """Rows follow their readers: a request whose consumer has `pause_at` outputs it has not taken (its client
    stopped reading: the socket is full) stops being stepped, its row and K/V memory given back; once the consumer
    is down to `resume_at`, it is prefilled again and goes on. A consumer keeping up never has more than a
    step's outputs waiting."""

    pause_at: int = 16
    resume_at: int = 4


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    paused: int  # requests whose clients are not reading: set aside, holding no row
    rows_in_use: int
    kv_blocks_used: int  # K/V cache blocks held by requests (cached prefixes nobody holds are free)
    kv_blocks_cached: int  # free blocks keeping a prefix for reuse until the pool needs them
    in_flight: int


class AsyncEngine(EngineThread):
    """Thread-safe bridge between the event loop and the `EngineCore` thread.

    Admission is decided at once on the event loop (`submit` raises `EngineOverloaded`); outputs
    come back with `loop.call_soon_threadsafe` into a per-request queue, one hop per engine step.
    """

    def __init__(
        self,
        core: EngineCore,
        max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS,
        flow: FlowControl | None = None,
    ) -> None:
        super().__init__("engine")
        self._core = core
        self._max_pending = max_pending_outputs
        self._flow_control = flow or FlowControl()
        # Handed from the event loop to the engine thread under `_cv`; applied between steps.
        self._new: list[EngineRequest] = []
        self._aborted: list[tuple[str, str]] = []  # (request id, why)
        self._flow: list[tuple[str, bool]] = []  # (request id, pause?) in the order the event loop decided them
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._paused: set[str] = set()  # on the event loop: the requests it asked the engine to pause
        self._retry_after = RetryAfter()  # for the Retry-After of a 429
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().start()

    def stats(self) -> EngineStats:
        scheduler = self._core.scheduler
        kv = self._core.kv.usage()
        return EngineStats(
            running=len(scheduler.running) + len(scheduler.prefilling),  # both hold KV state
            waiting=len(scheduler.waiting),
            paused=len(scheduler.paused),
            rows_in_use=self._core.slots.in_use,
            kv_blocks_used=kv.blocks_used,
            kv_blocks_cached=kv.blocks_cached,
            in_flight=len(self._streams),
        )

    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Admits all the requests or none of them (raises `EngineOverloaded`). Call on the event loop."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        capacity = self._core.scheduler.capacity
        if len(requests) > capacity:
            raise TooManySequences(
                f"this request needs {len(requests)} sequences but the server holds at most {capacity} at once"
            )
        fresh = sum(not request.continuation for request in requests)
        ahead = len(self._streams) + len(requests) - capacity  # requests that must leave before these fit
        if fresh and ahead > 0:
            raise EngineOverloaded(
                f"server is at capacity ({capacity} requests running or queued); retry later",
                retry_after_s=self._retry_after_s(ahead),
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
            self._new.extend(requests)
            self._cv.notify()
        return streams

    def _retry_after_s(self, ahead: int) -> int:
        """When `ahead` of the requests in flight will have left (read on the event loop; the lists are copied whole,
        which the engine thread cannot interleave with)."""
        scheduler = self._core.scheduler
        running = [*scheduler.running.values(), *scheduler.prefilling.values()]
        with self._cv:
            submitted = [request.params.max_tokens for request in self._new]
        waiting = [seq.remaining_tokens for seq in list(scheduler.waiting.values())] + submitted
        rows = [(len(seq.output_ids), seq.remaining_tokens) for seq in running]
        return self._retry_after.seconds(ahead, scheduler.max_running, rows, waiting)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return self.submit([request])[0]

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its row is freed at the next step boundary. Idempotent."""
        if self._streams.pop(request_id, None) is None:
            return
        self._paused.discard(request_id)
        with self._cv:
            self._aborted.append((request_id, "its consumer stopped"))
            self._cv.notify()

    def fail_in_flight(self, message: str) -> int:
        """Ends every request in flight at once with a shutdown error (call on the event loop).

        Each stream gets a final `ErrorKind.SHUTDOWN` output, so clients are told why they were cut
        off; the engine thread frees the rows at its next step boundary. Returns how many were ended.
        """
        ended = list(self._streams)
        for request_id in ended:
            self._end(request_id, message, ErrorKind.SHUTDOWN)
        return len(ended)

    def _end(self, request_id: str, message: str, kind: ErrorKind) -> None:
        """Ends a request from the event loop: its consumer gets one final error output, the engine frees its row."""
        queue = self._streams.pop(request_id)
        self._paused.discard(request_id)
        while not queue.empty():  # what it did not take is dropped: the error says why
            queue.get_nowait()
        queue.put_nowait(
            RequestOutput(
                request_id=request_id,
                text="",
                token_ids=[],
                prompt_tokens=0,
                completion_tokens=0,
                finish_reason=FinishReason.ERROR,
                error=message,
                error_kind=kind,
            )
        )
        with self._cv:
            self._aborted.append((request_id, kind.value))
            self._cv.notify()

    async def _stream(self, request_id: str, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                if request_id in self._paused and queue.qsize() <= self._flow_control.resume_at:
                    self._send_flow(request_id, pause=False)
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
                self._paused.discard(output.request_id)
                if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    self._retry_after.record_answer(output.completion_tokens)
            elif queue.qsize() >= self._max_pending:
                logger.warning(
                    "request %s: its consumer is %d outputs behind (client not reading); aborted",
                    output.request_id,
                    queue.qsize(),
                    extra={"request_id": output.request_id},
                )
                self._end(output.request_id, "the client stopped reading the response", ErrorKind.STALLED)
                self._core.observer.on_stream_stalled()
                continue
            queue.put_nowait(output)
            if (
                not output.finished
                and queue.qsize() >= self._flow_control.pause_at
                and output.request_id not in self._paused
            ):
                self._send_flow(output.request_id, pause=True)

    def _send_flow(self, request_id: str, pause: bool) -> None:
        """Asks the engine thread to pause or resume a request (called on the event loop)."""
        if pause:
            self._paused.add(request_id)
        else:
            self._paused.discard(request_id)
        with self._cv:
            self._flow.append((request_id, pause))
            self._cv.notify()

    def _add(self, request: EngineRequest) -> None:
        try:
            self._core.add(request)
        except Exception as exc:  # a request the engine cannot take fails alone
            logger.exception("request %s could not be added", request.request_id)
            failed = RequestOutput(
                request_id=request.request_id,
                text="",
                token_ids=[],
                prompt_tokens=request.prompt_tokens,
                completion_tokens=0,
                finish_reason=FinishReason.ERROR,
                error=f"{type(exc).__name__}: {exc}",
            )
            self._publish([failed])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to the event loop (called on the engine thread)."""
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _run(self) -> None:
        core = self._core
        core.on_engine_thread()
        while True:
            with self._cv:
                while not (
                    self._new or self._aborted or self._flow or self._calls or core.has_work() or self._stopping
                ):
                    self._cv.wait()
                if self._stopping:
                    break
                new, self._new = self._new, []
                aborted, self._aborted = self._aborted, []
                flow, self._flow = self._flow, []
                calls = self._take_calls()
            self._run_calls(calls)
            try:
                for request in new:
                    self._add(request)
                for request_id, why in aborted:  # after the adds: an abort may name a request submitted just before
                    core.abort(request_id, why)
                for request_id, pause in flow:  # after the aborts: an aborted request is gone, not paused
                    if pause:
                        core.pause(request_id)
                    else:
                        core.resume(request_id)
                decoding = bool(core.scheduler.running)
                started = time.perf_counter()
                outputs = core.step(publish=self._publish)  # also when idle: the step reports the freed rows
                if decoding:
                    self._retry_after.record_step(time.perf_counter() - started)
            except Exception as exc:  # keep serving: fail what was in flight and go on
                logger.exception("engine step failed")
                outputs = core.fail_all(exc)
            self._publish(outputs)
        self._cancel_calls()
        if self._loop is not None and not self._loop.is_closed():
            self._publish(self._core.fail_all(EngineStopped("the engine stopped")))
