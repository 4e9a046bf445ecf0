"""A streamed chat answer as Anthropic's events: message_start, each content block started, filled by deltas and
stopped, then message_delta (the stop reason and usage) and message_stop."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Literal

from transformers_openai.protocol import ChatCompletionChunk, DeltaToolCall, Usage
from transformers_openai.protocol.messages import (
    AnthropicErrorResponse,
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    DeltaUsage,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageEvent,
    MessageResponse,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
)
from transformers_openai.serving.errors import OpenAIError
from transformers_openai.serving.messages.answer import message_id, stop_reason_of, tool_use_id
from transformers_openai.serving.text.chat_event_stream import ChatEventStream
from transformers_openai.serving.text.tool_parser import new_call_id

BlockKind = Literal["text", "thinking", "tool_use"]


class MessageStream(ChatEventStream[MessageEvent]):
    """The events of one streamed message; an async iterator the SSE helper sends as named events.

    It reads a chat stream that carries usage on every chunk: message_start, which names the input tokens, waits
    for the first of them.
    """

    def __init__(self, model: str, chunks: AsyncIterator[ChatCompletionChunk]) -> None:
        super().__init__(chunks)
        self._model = model
        self._id = ""
        self._usage: Usage | None = None
        self._started = False
        self._open: BlockKind | None = None  # the kind of the block being filled
        self._blocks = 0  # blocks started so far: the next one's index
        self._finish_reason: str | None = None
        self._stop_string: str | None = None
        self._called = False

    def error_event(self, error: OpenAIError) -> AnthropicErrorResponse:
        """The event that reports a failure after the stream began."""
        return error.anthropic_body()

    async def _generate(self) -> AsyncGenerator[MessageEvent]:
        try:
            async for chunk in self._chunks:
                self._id = self._id or message_id(chunk.id)
                self._usage = chunk.usage or self._usage
                for event in self._read(chunk):
                    yield event
            for event in [*self._start(), *self._close()]:
                yield event
            stop_reason = stop_reason_of(self._finish_reason, self._stop_string, self._called)
            stop_sequence = self._stop_string if stop_reason == "stop_sequence" else None
            usage = self._usage
            yield MessageDeltaEvent(
                delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                usage=DeltaUsage(
                    input_tokens=usage.prompt_tokens if usage else 0,
                    output_tokens=usage.completion_tokens if usage else 0,
                ),
            )
            yield MessageStopEvent()
        finally:
            await self._chunks.aclose()  # type: ignore[attr-defined]

    def _read(self, chunk: ChatCompletionChunk) -> Iterator[MessageEvent]:
        if chunk.usage is not None:
            yield from self._start()
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                yield from self._fill("thinking", ThinkingDelta(thinking=delta.reasoning_content))
            if delta.content:
                yield from self._fill("text", TextDelta(text=delta.content))
            for call in delta.tool_calls or []:
                yield from self._call_piece(call)
            if choice.finish_reason is not None:
                self._finish_reason = choice.finish_reason
                self._stop_string = choice.stop_reason

    def _start(self) -> Iterator[MessageEvent]:
        """message_start, once: the input tokens as the chat usage counts them."""
        if self._started:
            return
        self._started = True
        usage = self._usage
        message = MessageResponse(
            id=self._id,
            model=self._model,
            content=[],
            usage=MessageUsage(
                input_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else 0,
            ),
        )
        yield MessageStartEvent(message=message)

    def _fill(self, kind: BlockKind, delta: TextDelta | ThinkingDelta) -> Iterator[MessageEvent]:
        if self._open != kind:
            block: ContentBlock = TextContent(text="") if kind == "text" else ThinkingContent(thinking="")
            yield from self._open_block(kind, block)
        yield ContentBlockDeltaEvent(index=self._blocks - 1, delta=delta)

    def _call_piece(self, piece: DeltaToolCall) -> Iterator[MessageEvent]:
        if piece.id is not None or self._open != "tool_use":  # a call's first piece carries its id and name
            self._called = True
            call_id = tool_use_id(piece.id or new_call_id())
            block = ToolUseContent(id=call_id, name=piece.function.name or "", input={})
            yield from self._open_block("tool_use", block)
        if piece.function.arguments:
            yield ContentBlockDeltaEvent(
                index=self._blocks - 1, delta=InputJsonDelta(partial_json=piece.function.arguments)
            )

    def _open_block(self, kind: BlockKind, block: ContentBlock) -> Iterator[MessageEvent]:
        yield from self._start()
        yield from self._close()
        self._open = kind
        self._blocks += 1
        yield ContentBlockStartEvent(index=self._blocks - 1, content_block=block)

    def _close(self) -> Iterator[MessageEvent]:
        if self._open is not None:
            self._open = None
            yield ContentBlockStopEvent(index=self._blocks - 1)
