"""Connections are held only as long as they do their part: idle ones closed, slow senders get 408, malformed
requests 400, connections beyond the limit 503, bodies beyond the bytes in flight 503 and a foreign Host header 400,
all in our error shape."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server, wait_for

HEADER_S, BODY_S, KEEP_ALIVE_S, MAX_CONNECTIONS = 1.5, 1.5, 1, 6
INFLIGHT_BYTES = 1024 * 1024
JSON = {"content-type": "application/json"}
SLACK_S = 1.0  # timers fire on the event loop of a busy 2-core machine


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_llama_dir, server_logs, "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S),
        "--keep-alive-timeout", str(KEEP_ALIVE_S), "--max-connections", str(MAX_CONNECTIONS),
        "--max-inflight-bytes", str(INFLIGHT_BYTES),
    )  # fmt: skip
    yield server
    server.stop()


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed it."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {timeout_s}s; got {data!r}") from None
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) off a kept-alive connection."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def parse(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def assert_our_error(raw: bytes, status: int, code: str | None) -> None:
    got, body = parse(raw)
    assert got == status, raw
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body


def request_head(server: ServerProcess, length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_silent_connection_is_closed_after_the_header_deadline(guarded: ServerProcess) -> None:
    with connect(guarded) as sock:
        data, waited = read_until_closed(sock, HEADER_S + 5)
    assert data == b""
    assert HEADER_S - 0.2 <= waited <= HEADER_S + SLACK_S


def test_a_kept_alive_connection_is_closed_when_idle(guarded: ServerProcess) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        rest, waited = read_until_closed(sock, KEEP_ALIVE_S + 5)
    assert rest == b"" and waited <= KEEP_ALIVE_S + SLACK_S


def test_a_header_sent_one_byte_at_a_time_gets_408(guarded: ServerProcess) -> None:
    head = request_head(guarded, 2)
    with connect(guarded) as sock:
        start = time.monotonic()
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # closed on us: the answer is already waiting
            time.sleep(0.25)
            if time.monotonic() - start > HEADER_S + SLACK_S:
                break
        data, _ = read_until_closed(sock, 5)
        assert time.monotonic() - start <= HEADER_S + SLACK_S + 0.5
    assert_our_error(data, 408, "request_timeout")


@pytest.mark.parametrize("sent", [b"{", b""], ids=["slow body", "short body"])
def test_a_body_that_does_not_arrive_gets_408(guarded: ServerProcess, sent: bytes) -> None:
    payload = json.dumps({"model": guarded.model, "prompt": "hi", "max_tokens": 2}).encode()
    with connect(guarded) as sock:
        sock.sendall(request_head(guarded, len(payload)) + sent)  # then nothing more: fewer bytes than declared
        data, waited = read_until_closed(sock, BODY_S + 5)
    assert_our_error(data, 408, "request_timeout")
    assert waited <= BODY_S + SLACK_S


def test_a_bad_content_length_gets_400_in_our_shape(guarded: ServerProcess) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n{}")
        data, _ = read_until_closed(sock, 5)
    assert_our_error(data, 400, "invalid_http")


def test_connections_beyond_the_limit_get_503_while_the_others_work(guarded: ServerProcess) -> None:
    held = [connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        with connect(guarded) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data, _ = read_until_closed(extra, 5)
        assert_our_error(data, 503, None)
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{guarded.root_url}/health", timeout=10).status_code == 200


def test_a_foreign_host_header_gets_400_before_the_app(guarded: ServerProcess) -> None:
    """DNS rebinding: a page of attacker.example whose name now points at 127.0.0.1 still sends its own Host."""
    port = guarded.port
    for head, status in [
        (f"GET /v1/models HTTP/1.1\r\nHost: attacker.example:{port}\r\n", 400),
        (f"GET /v1/models HTTP/1.1\r\nHost: localhost:{port}\r\n", 200),
        (f"GET /v1/models HTTP/1.1\r\nHost: [::1]:{port}\r\n", 200),
        ("GET /health HTTP/1.0\r\n", 200),  # no Host at all: an HTTP/1.0 health check, not a browser
    ]:
        with connect(guarded) as sock:
            sock.sendall(f"{head}Connection: close\r\n\r\n".encode())
            data, _ = read_until_closed(sock, 10)
        if status == 400:
            assert_our_error(data, 400, "invalid_host")
        else:
            assert parse(data)[0] == status, data


def test_bodies_past_the_bytes_in_flight_get_503_until_those_bytes_come_back(guarded: ServerProcess) -> None:
    payload = json.dumps({"model": guarded.model, "prompt": "hi", "max_tokens": 2}).encode()
    payload += b" " * (200 * 1024 - len(payload))
    with connect(guarded) as slow:
        slow.sendall(request_head(guarded, 900 * 1024) + b"{")  # 900 KiB reserved; its body never comes
        time.sleep(0.2)
        with connect(guarded) as sock:
            sock.sendall(request_head(guarded, len(payload)) + payload)
            refused = read_response(sock)
        assert_our_error(refused, 503, "server_overloaded")
        assert b"retry-after: 1" in refused.lower()
        data, _ = read_until_closed(slow, BODY_S + 5)
        assert_our_error(data, 408, "request_timeout")

    def answered() -> bool:  # the timed-out body's reservation is given back once the app sees the disconnect
        response = httpx.post(f"{guarded.base_url}/completions", content=payload, headers=JSON, timeout=30)
        return response.status_code == 200

    assert wait_for(answered, 10)
