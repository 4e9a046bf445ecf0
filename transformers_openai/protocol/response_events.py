"""The events of a streamed /v1/responses answer, each numbered by `sequence_number`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from transformers_openai.protocol.responses import OutputItem, OutputReasoningText, OutputText, ResponseObject


class ResponseEvent(BaseModel):
    """Every event names its type (also the SSE `event:` line) and its place in the stream."""

    type: str
    sequence_number: int = 0


class ResponseStateEvent(ResponseEvent):
    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
    ]
    response: ResponseObject


class OutputItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | OutputReasoningText


class TextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(ResponseEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningDoneEvent(ResponseEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDeltaEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(ResponseEvent):
    """A failure after the stream began (OpenAI's shape: the error's fields at the top level)."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None
