"""A streamed chat answer as the Responses events: created, in_progress, each output item opened, filled by deltas
and closed, then completed (or incomplete), numbered in order."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator

from transformers_openai.protocol import AssistantMessage, ChatCompletionChunk, DeltaMessage, DeltaToolCall, Usage
from transformers_openai.protocol.response_events import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    OutputItemEvent,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ResponseEvent,
    ResponseStateEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from transformers_openai.protocol.responses import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponseUsage,
)
from transformers_openai.serving.errors import OpenAIError
from transformers_openai.serving.text.chat_event_stream import ChatEventStream


class ResponseStream(ChatEventStream[ResponseEvent]):
    """The events of one streamed response; an async iterator the SSE helper sends as named events.

    `on_finished` gets the finished response (to be stored) before the last event is sent.
    """

    def __init__(
        self,
        skeleton: ResponseObject,
        chunks: AsyncIterator[ChatCompletionChunk],
        on_finished: Callable[[ResponseObject], None],
    ) -> None:
        super().__init__(chunks)
        self._skeleton = skeleton
        self._on_finished = on_finished
        self._sequence = 0
        self._output: list[OutputItem] = []
        self._reasoning: OutputReasoning | None = None  # the open reasoning item
        self._message: OutputMessage | None = None  # the open message item
        self._call: OutputFunctionCall | None = None  # the open function call item
        self._cut = False
        self._usage: ResponseUsage | None = None

    def error_event(self, error: OpenAIError) -> ResponseEvent:
        """The event that reports a failure after the stream began."""
        return self._numbered(ErrorEvent(code=error.code or error.type, message=error.message, param=error.param))

    async def _generate(self) -> AsyncGenerator[ResponseEvent]:
        try:
            yield self._state("response.created", self._skeleton)
            yield self._state("response.in_progress", self._skeleton)
            async for chunk in self._chunks:
                for event in self._read(chunk):
                    yield event
            if not any(isinstance(item, OutputMessage | OutputFunctionCall) for item in self._output) and (
                self._message is None and self._call is None
            ):
                for event in [*self._close(), *self._open_message()]:  # an answer of no text is still a message
                    yield event
            for event in self._close():
                yield event
            done = self._concluded()
            self._on_finished(done)
            yield self._state("response.incomplete" if self._cut else "response.completed", done)
        finally:
            await self._chunks.aclose()  # type: ignore[attr-defined]

    def _read(self, chunk: ChatCompletionChunk) -> Iterator[ResponseEvent]:
        if chunk.usage is not None:
            self._usage = response_usage(chunk.usage)
        for choice in chunk.choices:
            thought = reasoning_of(choice.delta)
            if thought:
                yield from self._thought(thought)
            if choice.delta.content:
                yield from self._text(choice.delta.content)
            for call in choice.delta.tool_calls or []:
                yield from self._call_piece(call)
            if choice.finish_reason is not None:
                self._cut = choice.finish_reason == "length"

    def _thought(self, delta: str) -> Iterator[ResponseEvent]:
        if self._reasoning is None:
            yield from self._close()
            self._reasoning = OutputReasoning(id=f"rs_{uuid.uuid4().hex}", content=[], status="in_progress")
            index = len(self._output)
            item = self._reasoning.model_copy(deep=True)
            yield self._numbered(OutputItemEvent(type="response.output_item.added", output_index=index, item=item))
            part = OutputReasoningText(text="")
            yield self._numbered(
                ContentPartEvent(
                    type="response.content_part.added", item_id=self._reasoning.id, output_index=index, part=part
                )
            )
            self._reasoning.content.append(part.model_copy())
        reasoning = self._reasoning
        reasoning.content[0].text += delta
        yield self._numbered(ReasoningDeltaEvent(item_id=reasoning.id, output_index=len(self._output), delta=delta))

    def _text(self, delta: str) -> Iterator[ResponseEvent]:
        if self._message is None:
            yield from self._close()
            yield from self._open_message()
        message = self._message
        assert message is not None
        message.content[0].text += delta
        yield self._numbered(TextDeltaEvent(item_id=message.id, output_index=len(self._output), delta=delta))

    def _open_message(self) -> Iterator[ResponseEvent]:
        self._message = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        index = len(self._output)
        yield self._numbered(
            OutputItemEvent(
                type="response.output_item.added", output_index=index, item=self._message.model_copy(deep=True)
            )
        )
        part = OutputText(text="")
        yield self._numbered(
            ContentPartEvent(
                type="response.content_part.added", item_id=self._message.id, output_index=index, part=part
            )
        )
        self._message.content.append(part.model_copy())

    def _call_piece(self, piece: DeltaToolCall) -> Iterator[ResponseEvent]:
        if piece.id is not None or self._call is None:  # a call's first piece carries its id and name
            yield from self._close()
            self._call = OutputFunctionCall(
                id=f"fc_{uuid.uuid4().hex}",
                call_id=piece.id or f"call_{uuid.uuid4().hex[:24]}",
                name=piece.function.name or "",
                arguments="",
                status="in_progress",
            )
            item = self._call.model_copy()
            yield self._numbered(
                OutputItemEvent(type="response.output_item.added", output_index=len(self._output), item=item)
            )
        call = self._call
        if piece.function.arguments:
            call.arguments += piece.function.arguments
            event = ArgumentsDeltaEvent(item_id=call.id, output_index=len(self._output), delta=piece.function.arguments)
            yield self._numbered(event)

    def _close(self) -> Iterator[ResponseEvent]:
        """Ends the open item (one at most: each opens after closing the last), if any, and adds it to the output."""
        index = len(self._output)
        status: ItemStatus = "incomplete" if self._cut else "completed"
        if self._reasoning is not None:
            reasoning, self._reasoning = self._reasoning, None
            thought = reasoning.content[0]
            yield self._numbered(ReasoningDoneEvent(item_id=reasoning.id, output_index=index, text=thought.text))
            yield self._numbered(
                ContentPartEvent(
                    type="response.content_part.done",
                    item_id=reasoning.id,
                    output_index=index,
                    part=thought.model_copy(),
                )
            )
            reasoning.status = status
            self._output.append(reasoning)
            yield self._numbered(
                OutputItemEvent(
                    type="response.output_item.done", output_index=index, item=reasoning.model_copy(deep=True)
                )
            )
        if self._message is not None:
            message, self._message = self._message, None
            part = message.content[0]
            yield self._numbered(TextDoneEvent(item_id=message.id, output_index=index, text=part.text))
            yield self._numbered(
                ContentPartEvent(
                    type="response.content_part.done", item_id=message.id, output_index=index, part=part.model_copy()
                )
            )
            message.status = status
            self._output.append(message)
            yield self._numbered(
                OutputItemEvent(
                    type="response.output_item.done", output_index=index, item=message.model_copy(deep=True)
                )
            )
        if self._call is not None:
            call, self._call = self._call, None
            yield self._numbered(ArgumentsDoneEvent(item_id=call.id, output_index=index, arguments=call.arguments))
            call.status = status
            self._output.append(call)
            yield self._numbered(
                OutputItemEvent(type="response.output_item.done", output_index=index, item=call.model_copy(deep=True))
            )

    def _concluded(self) -> ResponseObject:
        return self._skeleton.concluded(self._output, self._cut, self._usage)

    def _state(self, kind: str, response: ResponseObject) -> ResponseEvent:
        return self._numbered(ResponseStateEvent(type=kind, response=response))  # type: ignore[arg-type]

    def _numbered(self, event: ResponseEvent) -> ResponseEvent:
        event.sequence_number = self._sequence
        self._sequence += 1
        return event


def reasoning_of(message: AssistantMessage | DeltaMessage) -> str | None:
    """The thought the chat path split from an answer (a message or a delta), if any."""
    return message.reasoning_content


def response_usage(usage: Usage) -> ResponseUsage:
    """Chat's usage as the Responses API counts it, the thought's tokens among the output's."""
    details = usage.completion_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0),
        total_tokens=usage.total_tokens,
    )
