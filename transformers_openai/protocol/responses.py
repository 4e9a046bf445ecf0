"""The OpenAI wire protocol of /v1/responses: the request (its input items in `response_input`), and the response
object."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from transformers_openai.protocol.base import Strict, Text
from transformers_openai.protocol.common import priority_field
from transformers_openai.protocol.response_input import ITEM_KINDS, MESSAGE_PARTS, InputItem, item_kind, parts_of
from transformers_openai.protocol.structured_outputs import StructuredOutputsParams
from transformers_openai.protocol.tools import FunctionName

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
_HARMLESS: dict[str, list[Any]] = {
    "truncation": ["disabled"],
    "top_logprobs": [0],
    # Clients that keep no server state ask for their thoughts encrypted, to give them back: here a thought comes
    # in the clear (its reasoning_text) and is taken back from it, so there is nothing to encrypt.
    "include": [["reasoning.encrypted_content"]],
}


def _asks_for_nothing(name: str, value: Any) -> bool:
    if value in (None, False, [], {}) or value in _HARMLESS.get(name, []):
        return True
    # {"id": null}: an object that sets nothing
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
    priority: int = priority_field()
    reasoning: ReasoningConfig | None = None
    # vLLM's: a choice list, regex, grammar or JSON schema the answer follows (instead of text.format)
    structured_outputs: StructuredOutputsParams | None = None
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
                kind = item_kind(item)
                if kind not in ITEM_KINDS:
                    raise ValueError(
                        f"input items of type {kind!r} are not supported; "
                        "only 'message', 'function_call', 'function_call_output' and 'reasoning' items are"
                    )
                if kind == "message" and isinstance(item, dict):  # its parts' errors, not the input union's
                    parts_of(MESSAGE_PARTS)(item.get("content"))
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
