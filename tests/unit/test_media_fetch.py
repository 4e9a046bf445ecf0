"""Image URLs: the host list, the address check (also after redirects), the time and size bounds, other schemes."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from transformers_openai.model_loader import image_limits
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.vision.fetch import IPAddress, MediaFetcher, is_public
from transformers_openai.serving.vision.limits import ImageLimits
from transformers_openai.settings import Settings

PARAM = "messages.0.content.1"
BODY = b"\x89PNG not really, but bytes" * 10


class _Handler(BaseHTTPRequestHandler):
    """/image: BODY; /slow: answers after a second; /big: 10,000 bytes without a length; /big-declared: says 10,000;
    /to?url=...: a redirect there; /missing: 404."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path, _, query = self.path.partition("?")
        if path == "/image":
            self._send(200, BODY)
        elif path == "/slow":
            time.sleep(1.5)
            self._send(200, BODY)
        elif path == "/big":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"x" * 1000)
        elif path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", "10000")
            self.end_headers()
        elif path == "/to":
            self.send_response(302)
            self.send_header("Location", query.removeprefix("url="))
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a fetch that timed out has gone

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loopback_is_public(address: IPAddress) -> bool:
    """The test server's 127.0.0.1 stands in for a public host; every other address is judged as usual."""
    return address == ipaddress.ip_address("127.0.0.1") or is_public(address)


async def refused(fetcher: MediaFetcher, url: str) -> str:
    with pytest.raises(BadRequestError) as caught:
        await fetcher.fetch(url, PARAM)
    assert caught.value.param == PARAM
    return caught.value.message


def test_public_addresses() -> None:
    for text in ["93.184.215.14", "2606:4700::1111"]:
        assert is_public(ipaddress.ip_address(text)), text
    private = ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0"]
    private += ["240.0.0.1", "224.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::"]
    for text in private:
        assert not is_public(ipaddress.ip_address(text)), text


async def test_urls_are_refused_when_no_host_is_allowed(port: int) -> None:
    message = await refused(MediaFetcher(ImageLimits()), f"http://127.0.0.1:{port}/image")
    assert "data: URL" in message and "--allowed-media-domains" in message


async def test_other_schemes_are_refused() -> None:
    fetcher = MediaFetcher(ImageLimits(allowed_domains=frozenset({"*"}), allow_private=True))
    for url in ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://example.com/"]:
        assert "not supported" in await refused(fetcher, url)


async def test_allowed_host_is_fetched_and_others_are_not(port: int) -> None:
    limits = ImageLimits(allowed_domains=frozenset({"localhost"}), allow_private=True)
    assert await MediaFetcher(limits).fetch(f"http://LOCALHOST:{port}/image", PARAM) == BODY
    assert "not allowed" in await refused(MediaFetcher(limits), f"http://127.0.0.1:{port}/image")


async def test_loopback_is_refused_unless_private_urls_are_allowed(port: int) -> None:
    everywhere = frozenset({"*"})
    for host in ["localhost", "127.0.0.1", "[::ffff:127.0.0.1]"]:
        message = await refused(MediaFetcher(ImageLimits(allowed_domains=everywhere)), f"http://{host}:{port}/image")
        assert "--allow-private-media-urls" in message
    trusted = MediaFetcher(ImageLimits(allowed_domains=everywhere, allow_private=True))
    assert await trusted.fetch(f"http://localhost:{port}/image", PARAM) == BODY


async def test_redirects_are_checked_like_the_first_url(port: int) -> None:
    public_test_host = MediaFetcher(ImageLimits(allowed_domains=frozenset({"*"})), public=loopback_is_public)
    base = f"http://127.0.0.1:{port}"
    assert await public_test_host.fetch(f"{base}/to?url=/image", PARAM) == BODY  # to the same (public) host
    for target in ["http://10.0.0.1/image", "http://169.254.169.254/latest", f"http://127.0.0.2:{port}/image"]:
        assert "--allow-private-media-urls" in await refused(public_test_host, f"{base}/to?url={target}")
    one_host = MediaFetcher(ImageLimits(allowed_domains=frozenset({"127.0.0.1"})), public=loopback_is_public)
    assert "not allowed" in await refused(one_host, f"{base}/to?url=http://example.com/image")
    assert "not supported" in await refused(one_host, f"{base}/to?url=file:///etc/passwd")
    endless = f"{base}/to?url=/to?url=/to?url=/to?url=/to?url=/image"
    assert "redirects" in await refused(one_host, endless)


async def test_slow_server_times_out(port: int) -> None:
    limits = ImageLimits(allowed_domains=frozenset({"*"}), allow_private=True, fetch_timeout=0.3)
    started = time.monotonic()
    assert "timed out after 0.3 s" in await refused(MediaFetcher(limits), f"http://127.0.0.1:{port}/slow")
    assert time.monotonic() - started < 1.2


async def test_body_is_cut_at_the_byte_bound(port: int) -> None:
    limits = ImageLimits(allowed_domains=frozenset({"*"}), allow_private=True, max_bytes=4096)
    fetcher = MediaFetcher(limits)
    assert "--max-image-bytes" in await refused(fetcher, f"http://127.0.0.1:{port}/big")
    assert "--max-image-bytes" in await refused(fetcher, f"http://127.0.0.1:{port}/big-declared")


async def test_failed_fetches_name_their_cause(port: int) -> None:
    fetcher = MediaFetcher(ImageLimits(allowed_domains=frozenset({"*"}), allow_private=True))
    assert "HTTP 404" in await refused(fetcher, f"http://127.0.0.1:{port}/missing")
    assert "could not be resolved" in await refused(fetcher, "http://no-such-host.invalid/image")
    assert "fetching the image failed" in await refused(fetcher, f"http://127.0.0.1:{closed_port()}/image")


def _certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for `name` and its key (openssl, one day)."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}"]
        + ["-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """An https server on 127.0.0.1 whose certificate names 'localhost'; yields its port and the certificate."""
    cert, key = _certificate(tmp_path_factory.mktemp("tls"), "localhost")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1]), cert
    server.shutdown()
    server.server_close()


async def test_https_connects_to_the_checked_address_and_verifies_the_name(tls_port: tuple[int, Path]) -> None:
    port, cert = tls_port
    trusted = ssl.create_default_context(cafile=str(cert))
    limits = ImageLimits(allowed_domains=frozenset({"localhost", "127.0.0.1"}), allow_private=True)
    # Connected to 127.0.0.1, the certificate is checked against the name in the URL (SNI and verification).
    assert await MediaFetcher(limits, tls=trusted).fetch(f"https://localhost:{port}/image", PARAM) == BODY
    # The same server by its address: the certificate does not name it.
    assert "fetching the image failed" in await refused(
        MediaFetcher(limits, tls=trusted), f"https://127.0.0.1:{port}/image"
    )
    # A certificate no trusted authority signed.
    assert "fetching the image failed" in await refused(MediaFetcher(limits), f"https://localhost:{port}/image")


def test_limits_come_from_the_settings() -> None:
    settings = Settings(
        model="m",
        limit_mm_per_prompt=3,
        max_image_pixels=5000,
        max_image_bytes=4096,
        allowed_media_domains=["Images.Example.com.", " cdn.example.org", ""],
        allow_private_media_urls=True,
        media_fetch_timeout=2.5,
    )
    limits = image_limits(settings)
    assert (limits.max_images, limits.max_pixels, limits.max_bytes) == (3, 5000, 4096)
    assert limits.allowed_domains == {"images.example.com", "cdn.example.org"}
    assert limits.allow_private and limits.fetch_timeout == 2.5
    assert limits.allows_host("IMAGES.example.com.") and not limits.allows_host("evil.example.com")
    assert not image_limits(Settings(model="m")).allowed_domains  # none by default
    assert ImageLimits(allowed_domains=frozenset({"*"})).allows_host("anything.example")
