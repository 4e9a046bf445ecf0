"""The one SSE helper: pydantic chunks as `data:` events, an error event on failure, then `data: [DONE]`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from transformers_openai.serving.errors import to_openai_error

logger = logging.getLogger(__name__)

# Keep-alive comments let proxies hold long, quiet streams open; the OpenAI client ignores them.
PING_INTERVAL_S = 15


def sse_response(chunks: AsyncIterator[BaseModel]) -> EventSourceResponse:
    return EventSourceResponse(_events(chunks), ping=PING_INTERVAL_S, sep="\n")


async def _events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[ServerSentEvent]:
    try:
        async for chunk in chunks:
            yield ServerSentEvent(data=chunk.model_dump_json())
    except Exception as exc:  # the status line is sent already: report in-band
        error = to_openai_error(exc)
        if error.status_code >= 500:
            logger.exception("stream failed")
        yield ServerSentEvent(data=error.body().model_dump_json())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield ServerSentEvent(data="[DONE]")
