"""A CPU server with the compiled decode step is ready at once: it answers with eager decode steps while a child
process compiles the step, then swaps the compiled step in without a restart. The first answer comes from the eager
step, a later one from the compiled step (as `/metrics` says), and greedy outputs are identical."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.e2e.server import ServerProcess, start_server

PREFIX = "transformers_openai:"
COMPILE_TIMEOUT_S = 900  # a tiny model's two graphs: minutes of a busy 2-core machine


def gauge(server: ServerProcess, name: str) -> float:
    """One of the server's gauges, of its one model."""
    text = httpx.get(f"{server.root_url}/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(PREFIX + name + "{")]
    assert len(values) == 1, text
    return values[0]


def compiled(server: ServerProcess) -> float:
    return gauge(server, "decode_step_compiled")


def answer(server: ServerProcess, max_tokens: int = 24) -> str:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Count on."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def test_a_fresh_server_answers_eagerly_then_from_the_compiled_step(
    tiny_llama_dir: Path, server_logs: Path, tmp_path: Path
) -> None:
    store = tmp_path / "compiled-steps"
    server = start_server(tiny_llama_dir, server_logs, "--cpu-compile", "--compile-cache-dir", str(store))
    try:
        assert compiled(server) == 0 and gauge(server, "decode_step_compiling") == 1
        eager = answer(server)
        assert compiled(server) == 0  # the answer came from the eager step
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        while compiled(server) == 0:  # the swap happens between two engine steps: a short request makes one
            assert time.monotonic() < deadline, server.log_tail()
            assert "decode steps stay eager" not in server.log(), server.log_tail()
            time.sleep(2)
            answer(server, max_tokens=2)
        assert answer(server) == eager
        assert gauge(server, "decode_step_compiling") == 0
        log = server.log()
        assert "compiling the decode step" in log and "decode steps now run compiled" in log
        assert len(list(store.glob("decode-*.bin"))) == 2
    finally:
        server.stop()
