"""`--tensor-parallel-size 2`: two gloo ranks on the CPU serve what one process serves, token for token; cancelling
frees the rows; a dead rank takes the server down; SIGTERM stops every rank."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server, wait_for
from tests.e2e.streaming import completion_text, read_chunks
from tests.listening_sockets import ANY_ADDRESS, listening

TP = ("--tensor-parallel-size", "2")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "judge"]


def prompt(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


# 8 requests of mixed lengths: prompts of 1 to 300 words, 6 to 48 new tokens, half of them streamed, chat and
# completions. All greedy, so both servers must give the same tokens.
REQUESTS = [
    ("completions", {"prompt": prompt(1), "max_tokens": 48, "stream": True}),
    ("completions", {"prompt": prompt(300), "max_tokens": 6}),
    ("chat", {"messages": [{"role": "user", "content": prompt(12)}], "max_tokens": 32, "stream": True}),
    ("completions", {"prompt": prompt(40), "max_tokens": 24}),
    ("chat", {"messages": [{"role": "user", "content": prompt(150)}], "max_tokens": 16}),
    ("completions", {"prompt": prompt(7), "max_tokens": 40, "stream": True}),
    ("chat", {"messages": [{"role": "user", "content": prompt(3)}], "max_tokens": 20, "stream": True}),
    ("completions", {"prompt": prompt(90), "max_tokens": 12}),
]


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (its other ranks)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited


async def one(client: httpx.AsyncClient, server: ServerProcess, route: str, body: dict[str, Any]) -> str:
    url = f"{server.base_url}/{'chat/completions' if route == 'chat' else 'completions'}"
    body = {"model": "test-model", "temperature": 0, "ignore_eos": True, **body}
    if body.get("stream"):
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, await response.aread()
            chunks = await read_chunks(response)
        if route == "chat":
            return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        return completion_text(chunks)
    response = await client.post(url, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return str(choice["message"]["content"] if route == "chat" else choice["text"])


def answers(server: ServerProcess) -> list[str]:
    """Every request of REQUESTS, sent at once."""

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(one(client, server, route, body) for route, body in REQUESTS)))

    return asyncio.run(run())


def idle(server: ServerProcess) -> dict[str, Any]:
    engine: dict[str, Any] = {}

    def check() -> bool:
        engine.update(server.engine_state())
        return not (engine["rows_in_use"] or engine["kv_blocks_used"] or engine["running"] or engine["in_flight"])

    wait_for(check, 30)
    return engine


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_ranks(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, *TP)
    yield server
    server.stop()


def test_two_ranks_answer_as_one(one_rank: ServerProcess, two_ranks: ServerProcess) -> None:
    expected, got = answers(one_rank), answers(two_ranks)
    assert all(expected), expected
    assert got == expected
    assert "rank 1 of 2: ready" in two_ranks.log()
    assert idle(two_ranks)["kv_blocks_used"] == 0


def test_the_ranks_listen_on_loopback_only(two_ranks: ServerProcess) -> None:
    """The group's store (served by rank 0) and gloo's connections are on 127.0.0.1: nothing of the server listens
    on every interface (it serves HTTP on 127.0.0.1 unless --host says otherwise)."""
    pids = [two_ranks.process.pid, *child_pids(two_ranks.process.pid)]
    assert len(pids) == 2
    sockets = {pid: listening(pid) for pid in pids}
    assert ("127.0.0.1", two_ranks.port) in sockets[pids[0]]
    assert len(sockets[pids[0]]) >= 2, sockets  # HTTP and the store at least
    everywhere = {pid: [s for s in found if s[0] in ANY_ADDRESS] for pid, found in sockets.items()}
    assert not any(everywhere.values()), everywhere
    assert all(address == "127.0.0.1" for found in sockets.values() for address, _ in found), sockets


def test_a_cancelled_request_frees_its_rows(one_rank: ServerProcess, two_ranks: ServerProcess) -> None:
    body = {"model": "test-model", "prompt": prompt(20), "max_tokens": 600, "ignore_eos": True, "stream": True}

    async def walk_away() -> None:
        url = f"{two_ranks.base_url}/completions"
        async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            assert len(await read_chunks(response, limit=3)) == 3

    asyncio.run(walk_away())
    # Rank 0 holds every row and block table; the other rank holds none, so these are every rank's.
    engine = idle(two_ranks)
    assert engine["rows_in_use"] == 0 and engine["kv_blocks_used"] == 0 and engine["in_flight"] == 0, engine
    assert "aborted" in two_ranks.log()
    # The freed blocks are handed out again at once: what runs on them must still be right on both ranks.
    assert answers(two_ranks) == answers(one_rank)


def test_sigterm_drains_then_stops_every_rank(tiny_llama_dir: Path, server_logs: Path) -> None:
    server = start_server(tiny_llama_dir, server_logs, *TP)
    (rank1,) = child_pids(server.process.pid)
    body = {"model": "test-model", "prompt": "go", "max_tokens": 60, "ignore_eos": True, "temperature": 0}

    async def stream_across_the_signal() -> str:
        """A stream that gets its first event, then the server its SIGTERM; the stream read to its end."""
        lines: list[str] = []
        url, streamed = f"{server.base_url}/completions", {**body, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url, json=streamed) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and not any(seen.startswith("data: ") for seen in lines):
                    server.process.send_signal(signal.SIGTERM)
                lines.append(line)
        return "\n".join(lines)

    events = asyncio.run(stream_across_the_signal())
    assert events.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in events.replace(" ", "")
    assert server.process.wait(timeout=30) == 0
    assert wait_for(lambda: not alive(rank1), 10), "rank 1 still running"
    assert "rank 1: stopped" in server.log()


def test_a_dead_rank_ends_the_server(tiny_llama_dir: Path, server_logs: Path) -> None:
    server = start_server(tiny_llama_dir, server_logs, *TP)
    try:
        (rank1,) = child_pids(server.process.pid)
        killed = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        code = server.process.wait(timeout=30)
        assert code != 0
        assert time.monotonic() - killed < 30
        assert "rank 1 exited" in server.log()
    finally:
        server.stop()


def test_the_other_ranks_exit_when_rank_0_dies(tiny_llama_dir: Path, server_logs: Path) -> None:
    server = start_server(tiny_llama_dir, server_logs, *TP)
    (rank1,) = child_pids(server.process.pid)
    server.process.kill()
    server.process.wait()
    assert wait_for(lambda: not alive(rank1), 30), "rank 1 outlived rank 0"


@pytest.mark.parametrize(
    ("model_fixture", "message"),
    [
        ("tiny_t5_dir", "serves decoder-only language models"),
        ("tiny_mqa_llama_dir", "must divide the model's attention heads (4) and K/V heads (1)"),
    ],
)
def test_models_it_cannot_split_are_refused_at_start(
    model_fixture: str, message: str, request: pytest.FixtureRequest, server_logs: Path
) -> None:
    model = request.getfixturevalue(model_fixture)
    with pytest.raises(RuntimeError) as failure:
        start_server(model, server_logs, *TP, timeout_s=120)
    assert "server exited with 1" in str(failure.value)
    assert message in str(failure.value)
