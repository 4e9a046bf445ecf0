"""Raw SSE helpers over httpx, for tests that must disconnect mid-stream or read headers themselves."""

from __future__ import annotations

import json
from typing import Any

import httpx


async def read_chunks(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    """Reads `data:` events until [DONE] (or `limit` events)."""
    chunks: list[dict[str, Any]] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            break
        chunks.append(json.loads(data))
        if limit is not None and len(chunks) >= limit:
            break
    return chunks


def completion_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
