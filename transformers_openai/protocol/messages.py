"""Anthropic's Messages API on the wire: the request (`POST /v1/messages`, `/v1/messages/count_tokens`), the message
it answers with, the events of a streamed one, and its error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from transformers_openai.protocol.base import Strict, Text, Tolerant
from transformers_openai.protocol.text import MAX_STOP_CHARS, MAX_STOP_STRINGS
from transformers_openai.protocol.tools import FunctionName

# ---------------------------------------------------------------- content blocks a request carries


class TextBlock(Tolerant):
    """Text (its `cache_control` and `citations`, which change nothing here, are ignored)."""

    type: Literal["text"]
    text: Text


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: Text
    data: Text


class UrlSource(Strict):
    type: Literal["url"]
    url: Text


class ImageBlock(Tolerant):
    """An image, for a model that reads images."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]

    def url(self) -> str:
        """The image as the chat path takes it: a data URL or the URL."""
        source = self.source
        return source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(Tolerant):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text
    input: dict[Text, Any]


class ToolResultBlock(Tolerant):
    """What a call returned, given back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Text | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(block.text for block in content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Tolerant):
    """A thought the assistant had earlier (given back to the template as the message's reasoning)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(Tolerant):
    """A thought given back encrypted: this server never writes one, so there is nothing to read back."""

    type: Literal["redacted_thinking"]
    data: Text


InputBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
_USER_BLOCKS = (TextBlock, ImageBlock, ToolResultBlock)
_ASSISTANT_BLOCKS = (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)


class InputMessage(Tolerant):
    role: Literal["user", "assistant"]
    content: Text | list[InputBlock]

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> InputMessage:
        allowed = _USER_BLOCKS if self.role == "user" else _ASSISTANT_BLOCKS
        for block in self.content if isinstance(self.content, list) else []:
            if not isinstance(block, allowed):
                raise ValueError(f"a '{self.role}' message cannot have a '{block.type}' block")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


# ---------------------------------------------------------------- tools, thinking and the other settings


class ToolDefinition(Tolerant):
    """A client tool; Anthropic's server tools (web search, code execution, ...) have a `type` and are refused."""

    name: FunctionName
    description: Text | None = None
    input_schema: dict[Text, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None


class _Choice(Strict):
    disable_parallel_tool_use: bool = False


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class NoneChoice(Strict):
    type: Literal["none"]


class NamedChoice(_Choice):
    type: Literal["tool"]
    name: FunctionName


ToolChoice = Annotated[AutoChoice | AnyChoice | NoneChoice | NamedChoice, Field(discriminator="type")]


class ThinkingConfig(Strict):
    """`enabled` and `adaptive` turn the chat template's thinking switch on, `disabled` off; `budget_tokens` is
    accepted, not enforced (the thought counts against `max_tokens`)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("'budget_tokens' is required when thinking is 'enabled'")
        return self


class Metadata(Strict):
    user_id: Text | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[Text, Any] = Field(alias="schema")


class OutputConfig(Strict):
    """Structured output (`format`) and how hard to think (`effort`: the chat template's reasoning_effort)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(Strict):
    """`POST /v1/messages/count_tokens`: the conversation as a request would give it, without generating."""

    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[Text, Any] | None = None  # prompt caching: accepted, changes nothing

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. `top_k` and the others are sent as extra body fields by current SDKs: here they are
    fields like any other."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _stop_sequences(self) -> MessagesRequest:
        stops = self.stop_sequences or []
        if any(not stop for stop in stops):
            raise ValueError("stop_sequences must not be empty strings")
        if sum(len(stop) for stop in stops) > MAX_STOP_CHARS:
            raise ValueError(f"the stop sequences may hold at most {MAX_STOP_CHARS} characters in all")
        return self

    @model_validator(mode="after")
    def _budget_under_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens (the thought counts against it)")
        return self


# ---------------------------------------------------------------- what the server answers

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str
    citations: None = None


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # the thought is the model's own, in the clear: nothing to sign


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextContent | ThinkingContent | ToolUseContent


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    # No prompt cache is billed here: zero, as Anthropic reports for a request that used none.
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---------------------------------------------------------------- the events of a streamed message


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class DeltaUsage(BaseModel):
    """Cumulative, as Anthropic sends them at the end."""

    input_tokens: int
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: DeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class AnthropicErrorBody(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    """An error on these routes, as a JSON body and as the `error` event of a stream."""

    type: Literal["error"] = "error"
    error: AnthropicErrorBody


MessageEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | AnthropicErrorResponse
)
