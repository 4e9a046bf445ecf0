"""A scripted stand-in for the engine: records what it is given and answers every request from a script."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from transformers_openai.engine.errors import EngineOverloaded, EngineStopped
from transformers_openai.engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput, TokenLogprob

FIRST_TOKEN_ID = 100  # piece k of every answer is token FIRST_TOKEN_ID + k


@dataclass
class Script:
    """How the fake answers each request.

    `pieces` are streamed one output each (cut to the request's max_tokens, then finish "length").
    `hang`: after the pieces, never finish; the stream waits until it is cancelled or the engine stops.
    `error_after`: after that many pieces, end with FinishReason.ERROR.
    `stop_string`: the stop string the last output reports (as the engine does when one ended the text).
    """

    pieces: list[str] = field(default_factory=lambda: ["Hello", ",", " world"])
    finish_reason: FinishReason = FinishReason.STOP
    hang: bool = False
    error_after: int | None = None
    stop_string: str | None = None  # the stop string the last output says ended it (finish_reason STOP)


@dataclass(frozen=True)
class FakeStats:
    """What the fake reports, read as the engine's stats are (attributes; /health shows them all)."""

    in_flight: int
    submitted: int


class FakeEngine:
    """Implements the serving layer's `EngineClient` surface without a model."""

    def __init__(self, script: Script | None = None, capacity: int = 64) -> None:
        self.script = script or Script()
        self.capacity = capacity
        self.submitted: list[EngineRequest] = []
        self.abort_calls: list[str] = []
        self.aborted: list[str] = []  # ids aborted while still in flight
        self.in_flight: set[str] = set()
        self._running = False
        self._stopped = asyncio.Event()
        self.shutdown_message: str | None = None

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        self._running = True
        self._stopped = asyncio.Event()

    async def stop(self) -> None:
        self._running = False
        self._stopped.set()

    def stats(self) -> FakeStats:
        return FakeStats(in_flight=len(self.in_flight), submitted=len(self.submitted))

    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        if not self._running:
            raise EngineStopped("the engine is not running")
        if len(self.in_flight) + len(requests) > self.capacity:
            raise EngineOverloaded(f"server is at capacity ({self.capacity}); retry later", retry_after_s=3)
        self.submitted.extend(requests)
        self.in_flight.update(r.request_id for r in requests)
        return [self._outputs(r, self.script) for r in requests]

    def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id in self.in_flight:
            self.in_flight.discard(request_id)
            self.aborted.append(request_id)

    def fail_in_flight(self, message: str) -> int:
        ended = len(self.in_flight)
        self.shutdown_message = message
        self._stopped.set()  # wakes the hanging streams, which then report the shutdown
        return ended

    async def _outputs(self, request: EngineRequest, script: Script) -> AsyncIterator[RequestOutput]:
        rid, prompt_len = request.request_id, len(request.prompt_token_ids)
        pieces = script.pieces[: request.params.max_tokens]
        truncated = len(pieces) < len(script.pieces)
        final = FinishReason.LENGTH if truncated else script.finish_reason
        for k, piece in enumerate(pieces):
            await asyncio.sleep(0)  # one engine step per output
            if rid not in self.in_flight:
                break  # aborted: like the real engine, nothing more ever comes
            if script.error_after == k:
                self.in_flight.discard(rid)
                yield RequestOutput(rid, "", [], prompt_len, k, finish_reason=FinishReason.ERROR, error="boom")
                return
            last = k == len(pieces) - 1 and not script.hang
            if last:
                self.in_flight.discard(rid)
            token_id = FIRST_TOKEN_ID + k
            yield RequestOutput(
                rid,
                piece,
                [token_id],
                prompt_len,
                k + 1,
                logprobs=_logprobs(token_id, request.params.logprobs),
                finish_reason=final if last else None,
                stop_string=script.stop_string if last and final is FinishReason.STOP else None,
            )
        if not pieces and not script.hang:
            self.in_flight.discard(rid)
            yield RequestOutput(rid, "", [], prompt_len, 0, finish_reason=final)
        if script.hang or rid in self.aborted:
            await self._stopped.wait()
        if self.shutdown_message is not None and rid in self.in_flight:
            self.in_flight.discard(rid)
            yield RequestOutput(
                rid,
                "",
                [],
                prompt_len,
                0,
                finish_reason=FinishReason.ERROR,
                error=self.shutdown_message,
                error_kind=ErrorKind.SHUTDOWN,
            )


def _logprobs(token_id: int, top: int | None) -> list[TokenLogprob] | None:
    if top is None:
        return None
    alternatives = [(token_id, -0.5), (token_id + 50, -1.5), (token_id + 60, -2.5)]
    return [TokenLogprob(token_id, -0.5, alternatives[:top])]
