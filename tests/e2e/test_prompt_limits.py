"""A chat of 300,000 empty messages (9.9 MB, under the body limit) is refused at once, three at a time, without
stalling other chats or keeping the memory it took."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.e2e.server import ServerProcess

MESSAGES = 300_000


def chat(server: ServerProcess, messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
    return {"model": server.model, "messages": messages, "max_tokens": max_tokens}


def test_huge_chats_are_refused_at_once_and_stall_nobody(tiny_server: ServerProcess) -> None:
    url = f"{tiny_server.base_url}/chat/completions"
    normal = chat(tiny_server, [{"role": "user", "content": "Hello there"}], 4)
    assert httpx.post(url, json=normal, timeout=30).status_code == 200  # warm: the baseline is a working server
    big = json.dumps(chat(tiny_server, [{"role": "user", "content": ""}] * MESSAGES, 4)).encode()
    assert len(big) < 10 * 1024 * 1024  # under --max-request-bytes: it is read and parsed
    rss_before = tiny_server.rss_bytes()

    results: dict[int, tuple[int, float, dict[str, object]]] = {}

    def send_big(index: int) -> None:
        start = time.monotonic()
        response = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
        results[index] = (response.status_code, time.monotonic() - start, response.json())

    senders = [threading.Thread(target=send_big, args=(i,)) for i in range(3)]
    for sender in senders:
        sender.start()
    time.sleep(1.0)
    start = time.monotonic()
    answer = httpx.post(url, json=normal, timeout=60)
    normal_s = time.monotonic() - start
    for sender in senders:
        sender.join(60)

    assert answer.status_code == 200 and normal_s < 2.0, normal_s
    for status, seconds, body in results.values():
        error = body["error"]
        assert status == 400 and seconds < 2.0, (status, seconds)
        assert isinstance(error, dict) and error["code"] == "too_many_messages" and error["param"] == "messages"
    assert len(results) == 3
    growth = tiny_server.rss_bytes() - rss_before
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MB"
