"""Shutdown that cannot wait: a second signal, or a drain that runs out of time, ends every open stream with an
error event in our shape and `data: [DONE]`, and the process exits non-zero. (The patient case, one SIGTERM
and streams that finish in time, is in test_operations.py.)"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server

STREAMS = 4
LONG = {"model": "test-model", "prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}


async def open_streams_then(server: ServerProcess, act: Callable[[], Awaitable[None]]) -> list[list[str]]:
    """Opens STREAMS long streams, reads a few events of each, runs `act`, then reads each to its end.

    Returns every stream's `data:` payloads.
    """
    url = f"{server.base_url}/completions"
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(started: asyncio.Event, go: asyncio.Event) -> list[str]:
            events: list[str] = []
            async with client.stream("POST", url, json=LONG) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        started.set()
                        await go.wait()
            return events

        starts = [asyncio.Event() for _ in range(STREAMS)]
        go = asyncio.Event()
        tasks = [asyncio.create_task(one(started, go)) for started in starts]
        async with asyncio.timeout(60):
            await asyncio.gather(*(started.wait() for started in starts))
            await act()
            go.set()
            return list(await asyncio.gather(*tasks))


def assert_ended_with_error_then_done(events: list[str]) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert set(error) == {"error"}, events[-2]
    assert error["error"]["type"] == "service_unavailable"
    assert "shutting down" in error["error"]["message"]
    finished = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-2] if "choices" in e]
    assert not any(finished), "ended with an error, not by finishing"


def signal_twice(server: ServerProcess) -> Callable[[], Awaitable[None]]:
    async def act() -> None:
        server.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        server.process.send_signal(signal.SIGTERM)

    return act


def signal_once(server: ServerProcess) -> Callable[[], Awaitable[None]]:
    async def act() -> None:
        server.process.send_signal(signal.SIGTERM)

    return act


@pytest.mark.parametrize(
    ("shutdown_timeout", "send_signals", "logged"),
    [("60", signal_twice, "signal 15 again"), ("1", signal_once, "drain timeout")],
    ids=["second signal", "drain runs out of time"],
)
def test_a_forced_shutdown_ends_every_stream_with_an_error_event_and_exits_non_zero(
    tiny_llama_dir: Path,
    server_logs: Path,
    shutdown_timeout: str,
    send_signals: Callable[[ServerProcess], Callable[[], Awaitable[None]]],
    logged: str,
) -> None:
    server = start_server(tiny_llama_dir, server_logs, "--shutdown-timeout", shutdown_timeout)
    try:
        streams = asyncio.run(open_streams_then(server, send_signals(server)))
        for events in streams:
            assert_ended_with_error_then_done(events)
        assert server.process.wait(timeout=20) == 1
        assert logged in server.log()
    finally:
        server.stop()
