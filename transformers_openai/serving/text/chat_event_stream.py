"""The base of the streams that retell a streamed chat answer in another API's events (Responses, Anthropic)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

from transformers_openai.protocol import ChatCompletionChunk

Event = TypeVar("Event")


class ChatEventStream(Generic[Event]):
    """An async iterator of events made from a chat stream's chunks by the subclass's `_generate`.

    Closing it closes the chat stream under it, also before the first event was asked for, so that the chat
    stream aborts what is unfinished.
    """

    def __init__(self, chunks: AsyncIterator[ChatCompletionChunk]) -> None:
        self._chunks = chunks
        self._events: AsyncGenerator[Event] = self._generate()  # runs nothing until the first event is asked for

    def __aiter__(self) -> ChatEventStream[Event]:
        return self

    async def __anext__(self) -> Event:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._chunks.aclose()  # type: ignore[attr-defined]

    def _generate(self) -> AsyncGenerator[Event]:
        raise NotImplementedError
