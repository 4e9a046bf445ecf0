"""The OpenAI wire protocol of /v1/responses: the request with its input items, and the response object."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from transformers_openai.protocol.base import Strict, Text, Tolerant
from transformers_openai.protocol.tools import FunctionName

# ---------------------------------------------------------------- input items

_TEXT_PARTS = ("input_text", "output_text")
_MESSAGE_PARTS = (*_TEXT_PARTS, "input_image")


class ContentText(Tolerant):
    """A text part of an input message: the user's `input_text`, or an earlier answer's `output_text`."""

    type: Literal["input_text", "output_text"]
    text: Text
    # What clients echo back of an earlier output_text part: accepted, not shown to the model.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def chat_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


_NO_FILE_ID = "'input_image' parts with a 'file_id' are not supported (there is no file store): send 'image_url'"
_NEEDS_URL = "an 'input_image' part needs 'image_url', a URL (a data: URL with the image in base64)"


class InputImage(Tolerant):
    """An image in an input message, as a URL (a `data:` URL, or one the server may fetch); the chat path reads it
    as an `image_url` part, and a model that reads no images refuses it there."""

    type: Literal["input_image"]
    image_url: Text | None = None
    file_id: Text | None = None
    # "original" (OpenAI's full resolution) is read as "high": the model's processor decides the resolution.
    detail: Literal["auto", "low", "high", "original"] | None = None

    @model_validator(mode="after")
    def _a_url(self) -> InputImage:
        if self.file_id is not None:
            raise ValueError(_NO_FILE_ID)
        if self.image_url is None:
            raise ValueError(_NEEDS_URL)
        return self

    def chat_part(self) -> dict[str, Any]:
        detail = "high" if self.detail == "original" else self.detail
        return {"type": "image_url", "image_url": {"url": self.image_url, "detail": detail}}


def _parts_of(kinds: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in kinds:
                    names = " and ".join(repr(k) for k in kinds)
                    raise ValueError(f"content parts of type {kind!r} are not supported; only {names} parts are")
                if kind == "input_image":
                    _check_image(part)
        return value

    return check


def _check_image(part: dict[str, Any]) -> None:
    """Here, before the content's union is tried, so that the message says what is wrong with the image."""
    if part.get("file_id") is not None:
        raise ValueError(_NO_FILE_ID)
    if not isinstance(part.get("image_url"), str):
        raise ValueError(_NEEDS_URL)


def _joined(content: str | Sequence[ContentText | InputImage]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, ContentText))


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "image" if kind == "input_image" else "text"


MessagePart = Annotated[
    Annotated[ContentText, Tag("text")] | Annotated[InputImage, Tag("image")], Discriminator(_part_kind)
]


class MessageItem(Tolerant):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[MessagePart]
    id: Text | None = None
    status: Text | None = None
    phase: Text | None = None

    _known_parts = field_validator("content", mode="before")(_parts_of(_MESSAGE_PARTS))

    def text(self) -> str:
        return _joined(self.content)

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message holds it: the text, or its parts when it has images."""
        if isinstance(self.content, str) or not any(isinstance(p, InputImage) for p in self.content):
            return self.text()
        return [part.chat_part() for part in self.content]


class ReasoningText(Tolerant):
    type: Literal["reasoning_text"]
    text: Text


class SummaryText(Tolerant):
    type: Literal["summary_text"]
    text: Text


class ReasoningItem(Tolerant):
    """An earlier thought, given back with the conversation: shown to the chat template as the assistant message's
    `reasoning_content` (templates of reasoning models drop earlier thoughts themselves). `encrypted_content` is
    never produced here and cannot be read: it is accepted and not shown."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class FunctionCallItem(Tolerant):
    """A call the model made, given back with the conversation."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(Tolerant):
    """What a called function returned."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentText]
    id: Text | None = None
    status: Text | None = None

    _text_parts = field_validator("output", mode="before")(_parts_of(_TEXT_PARTS))

    def text(self) -> str:
        return _joined(self.output)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type", "message"))  # an "easy" message has a role and no type
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]
_ITEM_KINDS = frozenset({"message", "function_call", "function_call_output", "reasoning"})


# ---------------------------------------------------------------- tools, tool_choice and text format


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a 'json_schema' format needs 'name' and 'schema'")
        return self


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("'verbosity' is not supported: the model answers at its own length")
        return value


class ReasoningConfig(Strict):
    """How much the model should think: `effort` goes to the chat template as `reasoning_effort` (the chat field's
    values and checks); no summaries are generated, so `summary` is accepted and changes nothing."""

    effort: Text | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of `summary`


# ---------------------------------------------------------------- the request

# Known fields this server does not implement, and why: a 400 naming them unless their value asks for nothing.
_NOT_SUPPORTED: dict[str, str] = {
    "background": "responses are generated while the request waits",
    "conversation": "conversations are not stored: use 'previous_response_id'",
    "prompt": "stored prompt templates are not supported",
    "include": "no extra output data can be included",
    "truncation": "only 'disabled' is supported: a conversation too long for the context is refused",
    "top_logprobs": "log probabilities are not given by /v1/responses",
    "max_tool_calls": "there are no built-in tools",
    "context_management": "context management is not supported",
    "prompt_cache_options": "prompt caching options are not supported",
    "prompt_cache_retention": "prompt caching options are not supported",
    "moderation": "moderation is not supported",
    "image": "image options are not supported",
    "access_programs": "access programs are not supported",
    "background_options": "responses are generated while the request waits",
}
_HARMLESS: dict[str, list[Any]] = {"truncation": ["disabled"], "top_logprobs": [0]}


def _asks_for_nothing(name: str, value: Any) -> bool:
    if value in (None, False, [], {}) or value in _HARMLESS.get(name, []):
        return True
    # {"effort": null, "summary": null}: a reasoning config that sets nothing
    return isinstance(value, dict) and all(v is None for v in value.values())


def _reject_unsupported(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    if _asks_for_nothing(name, value):
        return value
    raise ValueError(f"'{name}' is not supported: {_NOT_SUPPORTED[name]}")


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice

# OpenAI's bounds on `metadata`: what the store keeps with each response stays small.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _bounded_metadata(value: Any) -> Any:
    """At most 16 pairs of strings, keys up to 64 characters and values up to 512 (checked before the pairs are
    validated one by one, so that every failure names `metadata` itself)."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise ValueError("must be an object of string keys and string values")
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed, got {len(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise ValueError("keys and values must be strings")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"values are at most {MAX_METADATA_VALUE_CHARS} characters; the value of '{key}' has {len(item)}"
            )
    return value


class ResponsesRequest(Strict):
    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: dict[Text, Any] | None = None  # include_obfuscation: there is nothing to obfuscate
    store: bool | None = None
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None
    reasoning: ReasoningConfig | None = None
    # Known OpenAI fields this server does not implement: a 400 naming them when used.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[Text] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    context_management: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Text | None = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None

    _unsupported = field_validator(*_NOT_SUPPORTED)(_reject_unsupported)
    _metadata = field_validator("metadata", mode="before")(_bounded_metadata)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("input must not be empty")
            for item in value:
                kind = _item_kind(item)
                if kind not in _ITEM_KINDS:
                    raise ValueError(
                        f"input items of type {kind!r} are not supported; "
                        "only 'message', 'function_call', 'function_call_output' and 'reasoning' items are"
                    )
                if kind == "message" and isinstance(item, dict):  # its parts' errors, not the input union's
                    _parts_of(_MESSAGE_PARTS)(item.get("content"))
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported; only 'function' tools are")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(f"tool_choice of type {value.get('type')!r} is not supported; name a 'function'")
        return value

    def is_stored(self) -> bool:
        """OpenAI stores responses unless asked not to."""
        return self.store is not False


# ---------------------------------------------------------------- the response object


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The model's thought before its answer (a reasoning model's): its text, never a summary."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputReasoning | OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(BaseModel):
    """What POST /v1/responses answers and GET /v1/responses/{id} gives back: the output and the settings."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: ResponseStatus
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None
    # The request's settings, echoed
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    user: str | None = None

    def concluded(self, output: list[OutputItem], cut: bool, usage: ResponseUsage | None) -> ResponseObject:
        """This response finished with `output`; `cut` when the token limit ended it."""
        return self.model_copy(
            update={
                "status": "incomplete" if cut else "completed",
                "completed_at": None if cut else int(time.time()),
                "output": output,
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
                "usage": usage,
            }
        )

    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
