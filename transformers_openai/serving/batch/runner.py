"""Runs the batches in the background: reads their input files, runs a bounded number of lines at a time through the
serving handlers, records each result as it comes, and writes the output and error files at the end.

Everything it knows is in the BatchStore, so a server started again over the same data directory picks up where it
stopped: lines answered before are not run again, and those in flight when it stopped run once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from itertools import chain

from transformers_openai.protocol.batches import Batch, BatchError, BatchErrors, FileObject
from transformers_openai.serving.batch.files import BatchLimits, new_file_id
from transformers_openai.serving.batch.lines import (
    EndpointHandlers,
    ReadFile,
    Retry,
    error_line,
    read_input,
    run_line,
)
from transformers_openai.serving.batch.store import BatchStore, PendingLine, now
from transformers_openai.serving.disconnect import ClientDisconnected
from transformers_openai.serving.errors import OpenAIError

logger = logging.getLogger(__name__)
IDLE_CHECK_S = 5.0  # how often an idle runner looks for expired batches
RETRY_S = 1.0  # how long a line the server could not take waits before it is tried again


class BatchRunner:
    """The one background task that drives every batch; `handlers` gives the served model's handlers (it raises a
    503 while the model loads)."""

    def __init__(self, store: BatchStore, limits: BatchLimits, handlers: Callable[[], EndpointHandlers]) -> None:
        self.store = store
        self.limits = limits
        self._handlers = handlers
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lines: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._cursor: dict[str, int] = {}  # per batch: the last line index handed out
        self._stops: dict[str, asyncio.Event] = {}  # per batch: set when its lines must stop (cancelled, expired)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._lines.values()) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.to_thread(self.store.close)

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        self._stop_lines(batch_id)
        self.wake()

    def _stop_lines(self, batch_id: str) -> None:
        self._stops.setdefault(batch_id, asyncio.Event()).set()

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except OpenAIError:  # the model is not loaded (or is going away): try again later
                pass
            except Exception:
                logger.exception("the batch runner failed a round; it goes on")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_CHECK_S)
            self._wake.clear()

    async def _tick(self) -> None:
        if not self.store.exists:  # nothing was ever stored: leave no trace on disk
            return
        handlers = self._handlers()
        running: list[Batch] = []
        for batch in await asyncio.to_thread(self.store.active_batches):
            if batch.status == "validating":
                await self._validate(batch)
            elif batch.status == "finalizing":
                await self._finish(batch, "completed")
            elif batch.status == "cancelling" or (batch.expires_at is not None and now() >= batch.expires_at):
                await self._end(batch)
            elif batch.status == "in_progress":
                running.append(batch)
        for batch in running:
            if not self._in_flight(batch.id) and not await asyncio.to_thread(self.store.has_pending, batch.id):
                batch.status, batch.finalizing_at = "finalizing", now()
                if await asyncio.to_thread(self.store.update_batch, batch, ("in_progress",)):
                    await self._finish(batch, "completed")
        await self._fill([batch for batch in running if batch.status == "in_progress"], handlers)

    def _in_flight(self, batch_id: str) -> bool:
        return any(key[0] == batch_id for key in self._lines)

    async def _validate(self, batch: Batch) -> None:
        try:
            data = await asyncio.to_thread(self.store.file_path(batch.input_file_id).read_bytes)
            read = await asyncio.to_thread(read_input, data, batch.endpoint, self.limits.max_lines)
        except OSError:  # deleted since the batch was created
            missing = BatchError(code="file_not_found", message=f"the input file '{batch.input_file_id}' is gone")
            read = ReadFile([], [missing])
        if read.errors:
            batch.status, batch.failed_at = "failed", now()
            batch.errors = BatchErrors(data=read.errors)
            await asyncio.to_thread(self.store.update_batch, batch, ("validating",))
            logger.info("batch %s failed validation: %s", batch.id, read.errors[0].message)
            return
        batch.status, batch.in_progress_at = "in_progress", now()
        batch.request_counts.total = len(read.lines)
        await asyncio.to_thread(self.store.start_lines, batch, read.lines)
        self._cursor.pop(batch.id, None)
        self.wake()  # its lines start in the next round

    async def _fill(self, batches: list[Batch], handlers: EndpointHandlers) -> None:
        """Starts lines while fewer than `concurrency` run, taking them from the batches in turn."""
        free = self.limits.concurrency - len(self._lines)
        if free <= 0 or not batches:
            return
        queues = []
        for batch in batches:
            after = self._cursor.get(batch.id, -1)
            lines = await asyncio.to_thread(self.store.pending_lines, batch.id, after, free + len(self._lines))
            if not lines and after >= 0:  # nothing past the cursor: a line given back (to retry) lies before it
                lines = await asyncio.to_thread(self.store.pending_lines, batch.id, -1, free + len(self._lines))
            queues.append((batch, [line for line in lines if (line.batch_id, line.index) not in self._lines]))
        taken = _round_robin([lines for _, lines in queues])[:free]
        endpoints = {batch.id: batch.endpoint for batch in batches}
        for line in taken:
            key = (line.batch_id, line.index)
            self._cursor[line.batch_id] = max(self._cursor.get(line.batch_id, -1), line.index)
            stop = self._stops.setdefault(line.batch_id, asyncio.Event())
            self._lines[key] = asyncio.create_task(self._run(line, endpoints[line.batch_id], handlers, stop))

    async def _run(self, line: PendingLine, endpoint: str, handlers: EndpointHandlers, stop: asyncio.Event) -> None:
        try:

            async def wait_stop() -> None:
                await stop.wait()

            result, is_error = await run_line(handlers, endpoint, line.custom_id, line.request, wait_stop)
            await asyncio.to_thread(self.store.record, line, result, is_error)
        except ClientDisconnected:
            pass  # the batch was cancelled or expired: the line stays unanswered
        except Retry as exc:
            logger.info("batch line %s waits: %s", line.custom_id, exc)
            await asyncio.sleep(RETRY_S)
            self._cursor[line.batch_id] = min(self._cursor.get(line.batch_id, -1), line.index - 1)
        finally:
            self._lines.pop((line.batch_id, line.index), None)
            self.wake()

    async def _end(self, batch: Batch) -> None:
        """A cancelled or expired batch: stops its lines, and once none runs, finishes it with what it answered."""
        self._stop_lines(batch.id)
        if self._in_flight(batch.id):
            return
        if batch.status == "cancelling":
            await self._finish(batch, "cancelled")
            return
        batch.status = "finalizing"
        batch.finalizing_at = now()
        await self._finish(batch, "expired")

    async def _finish(self, batch: Batch, status: str) -> None:
        files = await asyncio.to_thread(self._write_outputs, batch, status == "expired")
        for file in files:
            if file.filename.endswith("_output.jsonl"):
                batch.output_file_id = file.id
            else:
                batch.error_file_id = file.id
        stamp = now()
        if status == "completed":
            batch.status, batch.completed_at = "completed", stamp
        elif status == "cancelled":
            batch.status, batch.cancelled_at = "cancelled", stamp
        else:
            batch.status, batch.expired_at = "expired", stamp
        await asyncio.to_thread(self.store.finish, batch, files)
        self._cursor.pop(batch.id, None)
        self._stops.pop(batch.id, None)
        logger.info("batch %s %s: %s", batch.id, batch.status, batch.request_counts)

    def _write_outputs(self, batch: Batch, expired: bool) -> list[FileObject]:
        """Writes the output and error files from the recorded results (in a worker thread); an expired batch's
        lines never run get an error line each."""
        files = []
        outputs = self.store.results(batch.id, errors=False)
        errors = self.store.results(batch.id, errors=True)
        if expired:
            late = (
                error_line(custom_id, "batch_expired", "the batch expired before this line ran")
                for _, custom_id in self.store.unanswered(batch.id)
            )
            errors = chain(errors, late)
        for name, lines in (("output", outputs), ("error", errors)):
            first = next(lines, None)
            if first is None:
                continue
            file_id = new_file_id()
            size = self.store.write_bytes(file_id, (f"{line}\n".encode() for line in chain([first], lines)))
            filename = f"{batch.id}_{name}.jsonl"
            files.append(
                FileObject(id=file_id, bytes=size, created_at=now(), filename=filename, purpose="batch_output")
            )
        return files


def _round_robin(queues: list[list[PendingLine]]) -> list[PendingLine]:
    """One line of each queue in turn."""
    taken: list[PendingLine] = []
    for turn in range(max(len(queue) for queue in queues)):
        taken.extend(queue[turn] for queue in queues if turn < len(queue))
    return taken
