"""A streaming client that stops reading is dropped after --stream-stall-timeout: its engine requests are aborted,
the stall is counted and logged once; a client that leaves is logged as a disconnect, not a stall."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import CHAT, RawExchange, chat_body, eventually, make_app, running

STALL_S = 0.2


def stalled_total(metrics_text: str) -> float:
    name = "transformers_openai:request_stream_stalled_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith(name))


@pytest.fixture
def endless() -> FakeEngine:
    return FakeEngine(Script(pieces=["tok"] * 200, hang=True))  # keeps sending until the stream is ended


@pytest.mark.parametrize("n", [1, 2])
async def test_a_client_that_stops_reading_is_dropped_after_the_stall_timeout(
    endless: FakeEngine, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture, n: int
) -> None:
    app = make_app(endless, hf_tokenizer, stream_stall_timeout=STALL_S)
    async with running(app) as client:
        exchange = RawExchange(app, CHAT, chat_body(stream=True, n=n), request_id="slow-reader-1")
        task = asyncio.create_task(exchange.run())
        await asyncio.wait_for(exchange.got_event.wait(), 5)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            exchange.reading = False
            started = time.monotonic()
            await asyncio.wait_for(task, 5)  # the response gives up: no exception escapes the app
            waited_s = time.monotonic() - started
        assert await eventually(lambda: not endless.in_flight), endless.in_flight
        metrics = (await client.get("/metrics")).text
    assert STALL_S <= waited_s < STALL_S + 1.0
    assert sorted(endless.aborted) == sorted(r.request_id for r in endless.submitted)
    assert len(endless.submitted) == n
    assert stalled_total(metrics) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "slow-reader-1" in warnings[0] and "stalled" in warnings[0]


async def test_a_client_that_leaves_is_a_disconnect_not_a_stall(
    endless: FakeEngine, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(endless, hf_tokenizer, stream_stall_timeout=STALL_S)
    async with running(app) as client:
        exchange = RawExchange(app, CHAT, chat_body(stream=True), request_id="leaver-1")
        task = asyncio.create_task(exchange.run())
        await asyncio.wait_for(exchange.got_event.wait(), 5)
        with caplog.at_level(logging.WARNING):
            exchange.disconnect.set()
            await asyncio.wait_for(task, 5)
        assert await eventually(lambda: not endless.in_flight), endless.in_flight
        metrics = (await client.get("/metrics")).text
    assert endless.aborted == [endless.submitted[0].request_id]
    assert stalled_total(metrics) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "leaver-1" in warnings[0] and "disconnected" in warnings[0], warnings


async def test_a_reading_client_is_never_timed_out(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, stream_stall_timeout=STALL_S)
    async with running(app) as client:
        response = await client.post(CHAT, json=chat_body(stream=True))
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert stalled_total(metrics) == 0
