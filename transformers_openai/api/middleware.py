"""ASGI middleware: the Host header check, X-Request-Id, API-key authentication, CORS answering in our error shape,
and the headers that tell a load balancer which replica answered and how loaded it is."""

from __future__ import annotations

import hmac
import ipaddress
import json
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from transformers_openai.api.errors import error_response
from transformers_openai.logs import request_id_var
from transformers_openai.serving.errors import AuthenticationError, BadRequestError

REQUEST_ID_HEADER = "x-request-id"
_MAX_ID_LENGTH = 128


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


class AllowedHosts:
    """Answers 400 to a request whose Host header names none of `hosts`: a page of another site whose name was
    re-pointed at this address (DNS rebinding) still sends its own name. An entry matches the header's host part,
    with or without a port; '*' matches any, '*.example.com' its subdomains, '127.0.0.1' every 127.x address.
    A request without a Host header (HTTP/1.0 health checks) is not a browser's and passes."""

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app = app
        self._hosts = frozenset(_host_part(host) for host in hosts)
        self._any = "*" in self._hosts
        self._suffixes = tuple(host[1:] for host in self._hosts if host.startswith("*."))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._any or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", ())).get(b"host")
        if header is None or self.accepts(_host_part(header.decode("latin-1"))):
            await self.app(scope, receive, send)
            return
        error = BadRequestError("the Host header names a host this server does not answer for", code="invalid_host")
        await error_response(error, scope["path"])(scope, receive, send)

    def accepts(self, host: str) -> bool:
        if host in self._hosts or host.endswith(self._suffixes):
            return True
        return "127.0.0.1" in self._hosts and _is_ipv4_loopback(host)


def allowed_hosts(configured: list[str], bind_host: str) -> list[str]:
    """`--allowed-hosts`, or by default the loopback names when the server binds a loopback address, else any."""
    if configured:
        return configured
    return list(LOOPBACK_NAMES) if _is_loopback(bind_host) else ["*"]


def _host_part(value: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:80' -> '[::1]', '::1' -> '[::1]' (a bare IPv6 address)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    if value.count(":") > 1:
        return f"[{value}]"
    name, colon, port = value.rpartition(":")
    return name.rstrip(".") if colon and port.isdigit() else value.rstrip(".")


def _is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _is_ipv4_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 4 and address.is_loopback


class RequestIdMiddleware:
    """Takes the client's X-Request-Id (or makes one), exposes it to logs and handlers, and echoes it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1").strip()
        request_id = given[:_MAX_ID_LENGTH] if given and given.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


class ApiKeyAuth:
    """Requires `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) with one of the configured keys,
    compared in constant time. A WebSocket handshake may also offer the key as the subprotocol
    `openai-insecure-api-key.<key>` (what OpenAI's browser clients send, as browsers cannot set headers); one
    refused gets the same 401 in place of the upgrade."""

    def __init__(self, app: ASGIApp, keys: list[str], open_paths: Callable[[str], bool]) -> None:
        self.app = app
        self._keys = [key.encode() for key in keys]
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" or self._open(scope["path"]):
            await self.app(scope, receive, send)
            return
        if not self._matches(presented_key(scope)):
            error = AuthenticationError("invalid or missing API key; send 'Authorization: Bearer <key>'")
            response = error_response(error, scope["path"])
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _matches(self, token: bytes | None) -> bool:
        # Compare against every key so the time taken does not tell which key was close.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(token or b"", key)
        return token is not None and matched


KEY_SUBPROTOCOL = "openai-insecure-api-key."


def presented_key(scope: Scope) -> bytes | None:
    """The key a request presents: its `Authorization: Bearer` token, else its `x-api-key` (Anthropic's header),
    else (a WebSocket handshake) its `openai-insecure-api-key.<key>` subprotocol."""
    headers: dict[bytes, bytes] = dict(scope.get("headers", ()))
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    key = headers.get(b"x-api-key")
    if key is not None:
        return key.strip()
    offers: list[str] = list(scope.get("subprotocols", ())) if scope["type"] == "websocket" else []
    for offered in offers:
        if offered.startswith(KEY_SUBPROTOCOL):
            return offered[len(KEY_SUBPROTOCOL) :].encode("latin-1", "replace")
    return None


class Cors(CORSMiddleware):
    """Starlette's CORS handling, with a refused preflight answered in our error shape (it says plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = error_response(BadRequestError(bytes(response.body).decode(), code="cors_rejected"))
        for name in ("vary", "access-control-allow-methods", "access-control-max-age"):
            if name in response.headers:
                refused.headers[name] = response.headers[name]
        return refused


LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"  # a balancer asks for a load report in this format
LOAD_REPORT_HEADER = "endpoint-load-metrics"
REPLICA_ID_HEADER = "x-replica-id"


class ServerHeaders:
    """Says which server answered and how loaded it is: `X-Replica-Id` on every response where one is set, and an
    ORCA load report (`endpoint-load-metrics: JSON {...}` or `TEXT ...`, Envoy's format) when the request asks for
    one with `endpoint-load-metrics-format: json` or `text`."""

    def __init__(self, app: ASGIApp, replica_id: str | None, load: Callable[[], dict[str, float]]) -> None:
        self.app = app
        self._replica_id = replica_id
        self._load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        wanted = Headers(scope=scope).get(LOAD_FORMAT_HEADER, "").strip().lower()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if self._replica_id:
                    headers[REPLICA_ID_HEADER] = self._replica_id
                if wanted in ("json", "text"):
                    headers[LOAD_REPORT_HEADER] = load_report(self._load(), wanted)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def load_report(load: dict[str, float], form: str) -> str:
    """An ORCA load report of named metrics, as Envoy parses the `endpoint-load-metrics` header."""
    if form == "json":
        return "JSON " + json.dumps({"named_metrics": load}, separators=(",", ":"))
    return "TEXT " + ", ".join(f"named_metrics.{name}={value:g}" for name, value in load.items())
