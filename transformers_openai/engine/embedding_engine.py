"""The engine of an embedding model or a cross-encoder: requests queue up, its own thread runs them in length-sorted
batches.

A request's inputs are cut into pieces of at most `max_rows` inputs and `max_tokens` padded tokens (what one forward
may take). Each round the thread runs the next piece of every request it holds, batched together: concurrent
requests share forwards, a big request runs piece by piece in turn with the requests that come after it, and a
request whose caller left (cancelled) is dropped at the next forward, so it frees the engine within one piece.

An input is whatever the runner takes (token ids for an embedding model, a `TokenPair` for a cross-encoder); the
engine only needs its length.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Generic, Protocol

import numpy as np
import torch
from typing_extensions import TypeVar

from transformers_openai.engine.engine_thread import EngineThread
from transformers_openai.engine.errors import EngineError, EngineOverloaded, EngineStopped
from transformers_openai.engine.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

In = TypeVar("In", bound=Sized, default=list[int])  # one input of a runner
Vectors = list[np.ndarray]  # one float32 vector per input (a cross-encoder's: its score alone), in the request's order


@dataclass(frozen=True)
class TokenPair:
    """A query and a document tokenized together for a cross-encoder: the ids with the model's special tokens, and
    the token types that tell the two apart (None for a tokenizer without them, e.g. RoBERTa's)."""

    ids: list[int]
    type_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ids)


class Embedder(Protocol[In]):
    """What the engine needs of a runner (`runners.embedding.EmbeddingRunner`, `runners.cross_encoder.
    CrossEncoderRunner`, or a fake in tests): one row of floats per input."""

    def embed(self, inputs: list[In]) -> torch.Tensor: ...


@dataclass(frozen=True)
class EmbeddingStats:
    waiting: int  # requests queued for the next round
    in_flight: int  # requests admitted and not answered yet
    requests: int  # answered since start
    inputs: int  # inputs embedded since start
    forwards: int  # batched forwards run since start (fewer than the inputs: they were batched)
    dropped: int  # inputs never embedded because their request was cancelled first (its client left)


@dataclass(eq=False)
class _Job(Generic[In]):
    """A request in the engine: its inputs, the pieces not run yet and the vectors found so far."""

    inputs: list[In]
    future: concurrent.futures.Future[Vectors]  # stays pending until answered, so that a caller may cancel it
    pieces: deque[list[int]] = field(default_factory=deque)  # indexes into `inputs`, in the order they run
    vectors: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0  # inputs not embedded yet
    priority: int = 0  # lower runs first: a round takes only the jobs of the lowest value held

    @property
    def gone(self) -> bool:
        """Cancelled by its caller, or ended by `fail_in_flight` or a failed forward: nothing more to run."""
        return self.future.done()


# What one more forward costs, in tokens of work, against padding (a short input batched with a long one pays for
# the long one's length). On a CPU, work grows with the padded tokens and a forward's fixed cost is small (the cost
# of a few dozen batched tokens, measured for MiniLM). A GPU forward costs about the same for a few tokens as for
# thousands: there, fewer and fuller forwards win.
CPU_FORWARD_COST_TOKENS = 32
GPU_FORWARD_COST_TOKENS = 2048


def batches(
    lengths: Sequence[int], max_rows: int, max_tokens: int, forward_cost: int = CPU_FORWARD_COST_TOKENS
) -> list[list[int]]:
    """Indexes into `lengths`, shortest first, cut into batches of at most `max_rows` rows and `max_tokens` padded
    tokens (rows x the batch's longest; an input longer than that runs alone) so that the padded tokens plus
    `forward_cost` per forward are fewest: inputs of very different lengths go to different forwards."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sizes = [lengths[i] for i in order]
    # best[j]: the least cost of the first j inputs; cut[j]: where the last batch of that best split starts.
    best = [0] + [0] * len(sizes)
    cut = [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):
        best[j] = best[j - 1] + forward_cost + sizes[j - 1]  # the j-th input alone
        cut[j] = j - 1
        for i in range(j - 2, max(j - max_rows, 0) - 1, -1):  # the batch holds inputs i..j-1
            padded = (j - i) * sizes[j - 1]
            if padded > max_tokens:
                break
            if best[i] + forward_cost + padded < best[j]:
                best[j], cut[j] = best[i] + forward_cost + padded, i
    found: list[list[int]] = []
    j = len(sizes)
    while j > 0:
        found.append(order[cut[j] : j])
        j = cut[j]
    return found[::-1]


def cut_pieces(lengths: Sequence[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indexes into `lengths`, shortest first, cut into pieces of at most `max_rows` inputs and `max_tokens` padded
    tokens (an input longer than that is a piece of its own): the most of one request that one forward runs."""
    found: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and (len(current) >= max_rows or (len(current) + 1) * lengths[index] > max_tokens):
            found.append(current)
            current = []
        current.append(index)
    if current:
        found.append(current)
    return found


class EmbeddingEngine(EngineThread, Generic[In]):
    """Thread-safe bridge between the event loop and the thread that runs the embedding model.

    `embed` admits a request at once (raises `EngineOverloaded` when `max_requests` are in flight) and resolves
    when its vectors are ready; a caller that is cancelled costs no forward after the one running (its pieces not
    run yet are dropped, and a batch all of whose requests are gone is not run).
    """

    def __init__(
        self,
        runner: Embedder[In],
        max_rows: int,
        max_tokens: int,
        max_requests: int,
        threads: int,
        forward_cost: int = CPU_FORWARD_COST_TOKENS,
    ) -> None:
        super().__init__("embedding-engine")
        self.runner = runner
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.forward_cost = forward_cost
        self.max_requests = max_requests
        self._threads = threads
        self._jobs: list[_Job[In]] = []
        self._in_flight: set[concurrent.futures.Future[Vectors]] = set()
        self._requests = self._inputs = self._forwards = self._dropped = 0

    def stats(self) -> EmbeddingStats:
        with self._cv:
            return EmbeddingStats(
                waiting=len(self._jobs),
                in_flight=len(self._in_flight),
                requests=self._requests,
                inputs=self._inputs,
                forwards=self._forwards,
                dropped=self._dropped,
            )

    async def embed(self, inputs: list[In], priority: int = 0) -> Vectors:
        """The vectors of `inputs` (none of them empty), computed in batches with other requests' inputs.

        While jobs of a lower `priority` value are held, this one's pieces wait (Batch API lines run behind the
        interactive requests)."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        future: concurrent.futures.Future[Vectors] = concurrent.futures.Future()
        with self._cv:
            if len(self._in_flight) >= self.max_requests:
                raise EngineOverloaded(
                    f"server is at capacity ({self.max_requests} requests in flight); retry later", retry_after_s=1
                )
            self._in_flight.add(future)
            job = _Job(
                inputs, future, deque(cut_pieces([len(item) for item in inputs], self.max_rows, self.max_tokens))
            )
            job.vectors, job.left, job.priority = [None] * len(inputs), len(inputs), priority
            self._jobs.append(job)
            self._cv.notify()
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, future: concurrent.futures.Future[Vectors]) -> None:
        with self._cv:
            self._in_flight.discard(future)

    def fail_in_flight(self, message: str) -> int:
        """Ends every request not answered yet with `EngineStopped(message)`; returns how many."""
        with self._cv:
            futures = list(self._in_flight)
        ended = 0
        for future in futures:
            try:
                future.set_exception(EngineStopped(message))
                ended += 1
            except concurrent.futures.InvalidStateError:  # answered or cancelled meanwhile
                pass
        return ended

    # The generation surface of the EngineClient protocol: an embedding model generates nothing.
    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        raise EngineError("an embedding model does not generate text")

    def abort(self, request_id: str) -> None:
        return None  # embeddings are cancelled through their awaitable

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # the thread's own setting
        held: list[_Job[In]] = []  # requests with pieces left to run
        while True:
            with self._cv:
                while not (self._jobs or self._calls or self._stopping or held):
                    self._cv.wait()
                if self._stopping:
                    break
                held += self._jobs
                self._jobs = []
                calls = self._take_calls()
            self._run_calls(calls)
            held = self._retire(held)
            if held:
                first = min(job.priority for job in held)
                self._round([job for job in held if job.priority == first])
        with self._cv:
            left, self._jobs = held + self._jobs, []
        for job in left:
            job.future.cancel()
        self._cancel_calls()

    def _retire(self, jobs: list[_Job[In]]) -> list[_Job[In]]:
        """The jobs still to run; a cancelled one's inputs not embedded are counted as dropped."""
        keep = [job for job in jobs if job.pieces and not job.gone]
        dropped = sum(job.left for job in jobs if job.future.cancelled())
        if dropped:
            with self._cv:
                self._dropped += dropped
        return keep

    def _round(self, jobs: list[_Job[In]]) -> None:
        """Runs the next piece of each job, all of them batched together."""
        rows = [(job, index) for job in jobs for index in job.pieces.popleft()]
        lengths = [len(job.inputs[index]) for job, index in rows]
        for batch in batches(lengths, self.max_rows, self.max_tokens, self.forward_cost):
            live = [rows[i] for i in batch if not rows[i][0].gone]  # the client may have left since the last forward
            if live:
                self._forward(live)

    def _forward(self, rows: list[tuple[_Job[In], int]]) -> None:
        """Embeds one batch of (job, input index) rows; a job whose last input this was is answered."""
        try:
            vectors = self.runner.embed([job.inputs[index] for job, index in rows]).numpy()
        except Exception as exc:  # keep serving: these requests fail, the others and the next ones get their turn
            logger.exception("embedding batch failed")
            for job in dict.fromkeys(job for job, _ in rows):
                _settle(job.future, exception=EngineError(f"{type(exc).__name__}: {exc}"))
            return
        finished: list[_Job[In]] = []
        for row, (job, index) in enumerate(rows):
            job.vectors[index] = vectors[row]
            job.left -= 1
            if job.left == 0:
                finished.append(job)
        with self._cv:  # counted before the answers, so that a caller answered sees its forward counted
            self._forwards += 1
            self._inputs += len(rows)
        answered = sum(_settle(job.future, result=[v for v in job.vectors if v is not None]) for job in finished)
        with self._cv:
            self._requests += answered


def _settle(
    future: concurrent.futures.Future[Vectors], result: Vectors | None = None, exception: Exception | None = None
) -> bool:
    """Answers a future unless its caller cancelled it or `fail_in_flight` ended it first; whether it did."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result or [])
    except concurrent.futures.InvalidStateError:
        return False
    return True
