"""A benchmark measures the decode step a server keeps: it waits while the server compiles in the background
(`/metrics` `decode_step_compiling`), and not at all for a server or peer without that gauge."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from loadtest.server import runs_compiled, wait_compiled

PREFIX = "transformers_openai:"


@contextmanager
def metrics_server(pages: list[str]) -> Iterator[tuple[str, list[int]]]:
    """Serves `pages` as GET /metrics, one per request, the last one from then on; yields its URL and how many
    times it was read."""
    reads = [0]

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            page = pages[min(reads[0], len(pages) - 1)].encode()
            reads[0] += 1
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", reads
    finally:
        server.shutdown()
        server.server_close()


def page(compiling: int, compiled: int) -> str:
    labels = '{model_name="m"}'
    return (
        f"# HELP {PREFIX}decode_step_compiling Whether ...\n# TYPE {PREFIX}decode_step_compiling gauge\n"
        f"{PREFIX}decode_step_compiling{labels} {compiling}.0\n{PREFIX}decode_step_compiled{labels} {compiled}.0\n"
    )


def test_waits_while_the_server_compiles_then_reads_the_step_in_use() -> None:
    with metrics_server([page(1, 0), page(1, 0), page(0, 0), page(0, 1)]) as (url, reads):
        wait_compiled(url, timeout_s=60)
        assert reads[0] == 3  # two polls while compiling, then the one that found it made
        assert runs_compiled(url)


def test_does_not_wait_for_a_server_without_the_gauge_or_past_the_timeout() -> None:
    with metrics_server(["# a peer's metrics\nllamacpp:tokens_predicted_total 3\n"]) as (url, reads):
        began = time.monotonic()
        wait_compiled(url, timeout_s=60)
        assert reads[0] == 1 and time.monotonic() - began < 1
        assert not runs_compiled(url)
    with metrics_server([page(1, 0)]) as (url, reads):
        began = time.monotonic()
        wait_compiled(url, timeout_s=0.5)
        assert time.monotonic() - began < 5 and not runs_compiled(url)
