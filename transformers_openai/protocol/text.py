"""The OpenAI wire protocol of chat and completions, and its mapping to engine parameters."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from transformers_openai.engine.sampling_params import SamplingParams

# ---------------------------------------------------------------- requests


logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 64
# Longer logit_bias keys are beyond any vocabulary (and past a length, int() itself refuses them).
MAX_TOKEN_ID_DIGITS = 10
# Below this, a temperature means greedy decoding (dividing logits by it would overflow), as vLLM does.
GREEDY_TEMPERATURE = 1e-5


def _valid_unicode(value: str) -> str:
    """JSON escapes can carry lone UTF-16 surrogates, which no tokenizer (and no UTF-8 response) can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains invalid Unicode (a lone surrogate at position {exc.start})") from None
    return value


# Every string of a request: valid Unicode, never coerced from another type.
Text = Annotated[str, AfterValidator(_valid_unicode)]
# A logit_bias key: a token id in ASCII decimal (checked by `_bias_keys`, told to the OpenAPI document here).
TokenIdKey = Annotated[Text, WithJsonSchema({"type": "string", "pattern": "^[0-9]+$"})]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenId = Annotated[int, Field(ge=0)]  # at most the vocabulary, which the handler checks


class _Strict(BaseModel):
    # Unknown fields are answered with a 400 that names them, never dropped silently; like OpenAI, no
    # coercion: "2", 2.0 or true are not integers, "yes" is not a boolean (JSON integers are valid floats).
    # Python's json reads NaN and Infinity, which JSON does not have: no number field takes them.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the answer must validate against (always enforced)."""

    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when the type is 'json_schema'")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow; None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return None


class _Tolerant(BaseModel):
    """Inside messages and content parts, keys a client adds (`cache_control`, `provider_specific_fields`, ...)
    are ignored with a warning: unknown top-level fields still get their 400."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _ignore_extra_keys(self) -> Any:
        if self.model_extra:
            logger.warning("ignored unknown keys in a %s: %s", type(self).__name__, ", ".join(sorted(self.model_extra)))
            self.model_extra.clear()
        return self


class TextPart(_Tolerant):
    type: Literal["text"]
    text: Text


class ChatMessage(_Tolerant):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    # What clients echo back of an assistant reply (openai's message.model_dump(), LiteLLM): accepted in
    # history; none of it is shown to the model.
    refusal: Text | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    tool_calls: list[Any] | None = None
    function_call: Any = None

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_calls_yet(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"'{info.field_name}' in the history is not supported: no tool calling here yet")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported; only 'text' parts are")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# Fields OpenAI's API makes nullable: null means the default.
_NULL_MEANS_DEFAULT = frozenset(
    {"n", "stream", "logprobs", "echo", "ignore_eos", "min_tokens", "skip_special_tokens"}
)


class _SamplingRequest(_Strict):
    """Fields shared by chat and completions, including vLLM's extensions."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in _NULL_MEANS_DEFAULT}
        return data

    model: Text
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Text | list[Text] | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    # vLLM's extension: score the prompt, with this many alternatives per token (not with stream).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    user: Text | None = None
    # Accepted and harmless: we store nothing and have one service tier.
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:  # each is matched against every new piece of text
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):  # "²" and "٣" are digits to Python, not token ids
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
            if len(key.lstrip("0")) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"logit_bias token id {key[:MAX_TOKEN_ID_DIGITS]}... is outside the vocabulary")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("'prompt_logprobs' is not supported with 'stream'")
        return value

    @model_validator(mode="after")
    def _min_le_max(self) -> _SamplingRequest:
        limit = self.requested_max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return None

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt token when the prompt is to be scored; None when it is not."""
        return self.prompt_logprobs

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """vLLM's extension: usage so far on every chunk."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine parameters; `max_tokens` is already resolved against defaults and the context."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature < GREEDY_TEMPERATURE:
            temperature = 0.0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=self.logprobs_count(),
            prompt_logprobs=self.prompt_logprobs_count(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
        )


_NOT_SUPPORTED: dict[str, str] = {
    "tools": "this server does not do tool calling yet",
    "tool_choice": "this server does not do tool calling yet",
    "functions": "this server does not do function calling yet",
    "function_call": "this server does not do function calling yet",
    "audio": "audio output is not supported",
    "modalities": "only ['text'] is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "insertion (fill-in-the-middle) is not supported",
}

# Values of the unsupported fields that ask for nothing beyond plain text generation.
_HARMLESS: dict[str, list[Any]] = {
    "tool_choice": ["none"],
    "modalities": [["text"]],
}


def _reject_unsupported(value: Any, info: ValidationInfo) -> Any:
    """A field validator: a 400 whose `param` is the field, unless the value asks for nothing."""
    name = info.field_name or ""
    if value in (None, False, [], {}) or value in _HARMLESS.get(name, []):
        return value
    raise ValueError(f"'{name}' is not supported: {_NOT_SUPPORTED[name]}")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Known OpenAI fields this server does not implement yet: a 400 naming them when used.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Text | None = None
    web_search_options: Any = None

    _unsupported = field_validator(
        "tools", "tool_choice", "functions", "function_call", "audio", "modalities",
        "prediction", "web_search_options",
    )(_reject_unsupported)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    # 0 with `echo`: score the prompt only (lm-eval's loglikelihood requests of older versions).
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)

    _unsupported = field_validator("suffix")(_reject_unsupported)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be empty")
        return value


    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("'best_of' is not supported: only best_of equal to n")
        return value

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        if self.echo and self.logprobs is not None:  # echo with logprobs scores the prompt too, as OpenAI does
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """vLLM's shape of one token's score in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token: its score and its alternatives' by token id, or None for the first token (vLLM's extension).
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class AssistantMessage(BaseModel):
    role: str
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    # vLLM's extension, only when asked for (absent otherwise, as OpenAI's responses have no such key)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda value: value is None)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extension, only when asked for (absent otherwise, as OpenAI's responses have no such key)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda value: value is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
