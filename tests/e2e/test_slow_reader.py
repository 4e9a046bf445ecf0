"""Clients that stop reading cannot hold the batch: their streams are aborted after --stream-stall-timeout and
their rows freed, so a normal request waits at most about that long."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server, wait_for

# All four rows are taken together only while none of them has been aborted yet: the four requests are admitted one
# after the other while the first streams' big events keep the event loop busy, and on a loaded machine that can take
# long enough that a 2 s timeout could free the first row before the fourth came (all four never seen at once, in one
# full suite run).
STALL_S = 4.0
ROWS = 4
# Big events (20 alternatives per token, each with its bytes): the socket buffers fill within a few hundred
# tokens, so a client that never reads blocks the server's sends early. 900 tokens, as the tiny model's context
# is 1024; without the stall timeout these streams would hold their rows for seconds more.
MAX_TOKENS = 900
HEAVY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 20}
# Measured on 2 shared CPU cores: the normal request waits the stall timeout plus about 0.3 s for the buffers to fill
# once the rows are taken and about 0.1 s for its own answer; 3 s more covers a loaded machine.
MARGIN_S = 3.0


@pytest.fixture(scope="module")
def stall_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_llama_dir,
        server_logs,
        "--max-batch-size",
        str(ROWS),
        "--max-queue",
        "8",
        "--stream-stall-timeout",
        str(STALL_S),
    )
    yield server
    server.stop()


def body(server: ServerProcess, **extra: object) -> dict[str, object]:
    return {"model": server.model, "messages": [{"role": "user", "content": "Tell me a story."}], **extra}


def never_reads(server: ServerProcess) -> socket.socket:
    """Sends a streaming request by hand with a tiny receive buffer, then never reads a byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    payload = json.dumps(body(server, stream=True, **HEAVY)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def stalled_total(server: ServerProcess) -> float:
    text = httpx.get(f"{server.root_url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("transformers_openai:request_stream_stalled_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_four_clients_that_never_read_cannot_hold_the_batch(stall_server: ServerProcess) -> None:
    before = stalled_total(stall_server)
    sockets = [never_reads(stall_server) for _ in range(ROWS)]
    try:
        taken = wait_for(lambda: stall_server.engine_state()["rows_in_use"] == ROWS, 30)
        assert taken, f"the {ROWS} rows were never all taken at once:\n{stall_server.log_tail()}"
        start = time.monotonic()
        response = httpx.post(
            f"{stall_server.base_url}/chat/completions", json=body(stall_server, max_tokens=8), timeout=120
        )
        waited_s = time.monotonic() - start
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in {"stop", "length"}
        # The rows come free once a blocked send has waited the stall timeout.
        assert waited_s < STALL_S + MARGIN_S, waited_s
        assert wait_for(lambda: stalled_total(stall_server) - before == ROWS, 30)
        assert wait_for(lambda: stall_server.engine_state()["rows_in_use"] == 0, 30)
    finally:
        for sock in sockets:
            sock.close()
    # Freed by the stall timeout, not by finishing their answers.
    aborted = [int(n) for n in re.findall(r"aborted after (\d+) tokens", stall_server.log())]
    assert len(aborted) >= ROWS and all(n < MAX_TOKENS for n in aborted), aborted
    # One warning per stall, and no application error with a traceback.
    assert stall_server.log().count("stream stalled, the client took no data") == ROWS
    assert "Traceback" not in stall_server.log() and "Exception in ASGI application" not in stall_server.log()
