"""Container health probe: exit 0 when the server's GET /health answers 200, 1 otherwise.

Docker runs it inside the container (Dockerfile HEALTHCHECK, compose healthcheck). It reads the environment the
server reads: PORT (default 7088), HOST, and API_KEY / API_KEYS, whose first key it sends as a bearer token so the
probe keeps working with AUTH_HEALTH_AND_METRICS=true. Standard library only; set the port with PORT, not --port.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

DEFAULT_PORT = "7088"
TIMEOUT_S = 4.0


def _lower(env: Mapping[str, str]) -> dict[str, str]:
    # Settings reads environment variables case-insensitively.
    return {key.lower(): value for key, value in env.items()}


def health_url(env: Mapping[str, str]) -> str:
    lowered = _lower(env)
    host = lowered.get("host", "").strip()
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    port = lowered.get("port", "").strip() or DEFAULT_PORT
    return f"http://{host}:{port}/health"


def bearer_key(env: Mapping[str, str]) -> str | None:
    lowered = _lower(env)
    for name in ("api_key", "api_keys"):  # the order Settings tries its aliases in; a present one wins
        if name in lowered:
            keys = [part.strip() for part in lowered[name].split(",") if part.strip()]
            return keys[0] if keys else None
    return None


def probe(env: Mapping[str, str]) -> int:
    request = urllib.request.Request(health_url(env))
    key = bearer_key(env)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError as error:
        print(f"unhealthy: {error}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: /health answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(probe(os.environ))
