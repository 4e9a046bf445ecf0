"""Raw SSE helpers over httpx, for tests that must disconnect mid-stream or read headers themselves."""

from __future__ import annotations

import json
from typing import Any

import httpx


class SSEReader:
    """Reads `data:` events from one streaming response; it keeps the line iterator, so reads can resume.

    Dropping a partly read iterator closes the connection: that is how tests disconnect mid-stream.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def read(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Events until [DONE] or until `limit` of them."""
        chunks: list[dict[str, Any]] = []
        async for line in self._lines:
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
            if limit is not None and len(chunks) >= limit:
                break
        return chunks


async def read_chunks(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    """One read; with a `limit`, the connection is closed after it (a client that walks away)."""
    return await SSEReader(response).read(limit)


def completion_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
