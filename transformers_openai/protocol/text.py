"""The OpenAI wire protocol of chat and completions, and its mapping to engine parameters."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.protocol.base import Strict, Text, Tolerant
from transformers_openai.protocol.common import priority_field
from transformers_openai.protocol.structured_outputs import ConstraintFields, OutputConstraint
from transformers_openai.protocol.tools import (
    DeltaToolCall,
    HistoryToolCall,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
)

# ---------------------------------------------------------------- requests

MAX_STOP_STRINGS = 64
# Stop strings are read by an automaton built per request on the engine thread, in time and memory that follow their
# total length (about a millisecond and 35 KB a thousand characters); OpenAI takes up to 4 stop strings, vLLM any.
MAX_STOP_CHARS = 16384
# Longer logit_bias keys are beyond any vocabulary (and past a length, int() itself refuses them).
MAX_TOKEN_ID_DIGITS = 10
# Below this, a temperature means greedy decoding (dividing logits by it would overflow), as vLLM does.
GREEDY_TEMPERATURE = 1e-5


# A logit_bias key: a token id in ASCII decimal (checked by `_bias_keys`, told to the OpenAPI document here).
TokenIdKey = Annotated[Text, WithJsonSchema({"type": "string", "pattern": "^[0-9]+$"})]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenId = Annotated[int, Field(ge=0)]  # at most the vocabulary, which the handler checks


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`: the schema the answer must validate against (always enforced)."""

    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's types, and two that other servers take: `grammar` with a `grammar` (OpenRouter's and Fireworks'
    shape; GBNF or Lark here) and `regex` with a `value` (Text Generation Inference's shape)."""

    type: Literal["text", "json_object", "json_schema", "grammar", "regex"]
    json_schema: JsonSchemaFormat | None = None
    grammar: Text | None = None
    value: Text | None = None

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> ResponseFormat:
        needed = {"json_schema": "json_schema", "grammar": "grammar", "regex": "value"}.get(self.type)
        if needed is not None and getattr(self, needed) is None:
            raise ValueError(f"'{needed}' is required when the type is '{self.type}'")
        for name in ("json_schema", "grammar", "value"):
            if name != needed and getattr(self, name) is not None:
                raise ValueError(f"'{name}' does not go with the type '{self.type}'")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow; None for plain text or another constraint."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return None

    def constraint(self) -> OutputConstraint | None:
        """The constraint it sets on the answer; None for plain text."""
        schema = self.answer_schema()
        if schema is not None:
            return OutputConstraint("json", schema, "response_format")
        if self.type == "grammar":
            return OutputConstraint("grammar", self.grammar, "response_format.grammar")
        if self.type == "regex":
            return OutputConstraint("regex", self.value, "response_format.value")
        return None


class TextPart(Tolerant):
    type: Literal["text"]
    text: Text


class ImageURL(Strict):
    """Where an image part's image is: a `data:` URL (base64) or an http(s) URL the server may be allowed to fetch."""

    url: Text = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Tolerant):
    """An image in a message (OpenAI's `image_url` part), for a model that reads images."""

    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_alone(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value  # vLLM and others accept the bare string


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
_PART_TYPES = ("text", "image_url")


class ChatMessage(Tolerant):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[HistoryToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # which call a tool message answers
    # What clients echo back of an assistant reply (openai's message.model_dump(), LiteLLM): accepted in
    # history; none of it is shown to the model.
    refusal: Text | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    # An assistant's thought, as this server (vLLM's name and the older one) or a client echoes it back: given to the
    # template as `reasoning_content`, which templates that show earlier thoughts read (Qwen3's keeps the latest).
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @field_validator("function_call")
    @classmethod
    def _no_legacy_calls(cls, value: Any) -> Any:
        if value:
            raise ValueError("'function_call' in the history is not supported: use 'tool_calls'")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _PART_TYPES:
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported; only 'text' and 'image_url' parts are"
                    )
        return value

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message can have 'tool_calls'")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("only an 'assistant' message can have 'reasoning_content'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[ImagePart]:
        """The message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part for part in self.content if isinstance(part, ImagePart)]

    def for_template(self, images: bool = False) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention for tool calls and results). With
        `images`, content with image parts stays a list of parts, each image as `{"type": "image"}` where it stands
        (what processors' templates read); otherwise the content is the text."""
        # OpenAI's "developer" role is the newer name of "system"; templates know the latter.
        role = "system" if self.role == "developer" else self.role
        content: str | list[dict[str, str]] = self.text()
        if images and self.images() and isinstance(self.content, list):
            content = [
                {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
                for part in self.content
            ]
        message: dict[str, Any] = {"role": role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments_value()},
                }
                for call in self.tool_calls
            ]
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            message["reasoning_content"] = thought
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                message["name"] = self.name
        return message


# Fields OpenAI's API makes nullable: null means the default.
_NULL_MEANS_DEFAULT = frozenset(
    {"n", "stream", "logprobs", "echo", "ignore_eos", "min_tokens", "skip_special_tokens", "speculative_decoding"}
)


# SGLang's and vLLM's fields that vLLM's router (vllm-router, forked from SGLang's) writes into every request it
# forwards, at the defaults below. Each is accepted at the values this server honours; any other is a 400 naming it.
_ROUTER_FIELDS: dict[str, tuple[tuple[bool, ...], str]] = {
    "no_stop_trim": ((False,), "a matched stop string is always trimmed from the text"),
    "return_hidden_states": ((False,), "hidden states are not returned"),
}
# (Its reasoning fields, separate_reasoning, stream_reasoning and include_reasoning, are honoured at any value.)

# What OpenAI's reasoning_effort takes; it reaches the chat template as the variable `reasoning_effort`.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


def _router_field(value: bool, info: ValidationInfo) -> bool:
    """A field validator: the value, if this server honours it; a 400 naming the field otherwise."""
    name = info.field_name or ""
    accepted, reason = _ROUTER_FIELDS[name]
    if value not in accepted:
        raise ValueError(f"'{name}': {str(value).lower()} is not supported: {reason}")
    return value


def one_prompt_ending(value: bool, info: ValidationInfo) -> bool:
    """A field validator of `continue_final_message` (declared after `add_generation_prompt`): a prompt ends with
    the assistant's header or continues the last message, not both."""
    if value and info.data.get("add_generation_prompt", True):
        raise ValueError("'continue_final_message' needs 'add_generation_prompt': false")
    return value


class _SamplingRequest(ConstraintFields):
    """Fields shared by chat and completions, including vLLM's extensions (and the constraint fields of vLLM, SGLang
    and llama.cpp: `ConstraintFields`)."""

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
    priority: int = priority_field()
    stop: Text | list[Text] | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    # Ours: false keeps this request out of speculative decoding (when the server speculates: --speculative-config).
    speculative_decoding: bool = True
    # SGLang's, sent by vllm-router (_ROUTER_FIELDS)
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # vLLM's extension: score the prompt, with this many alternatives per token (not with stream).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    user: Text | None = None
    # Accepted and harmless: we store nothing and have one service tier.
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None

    _router_fields = field_validator("no_stop_trim", "return_hidden_states")(_router_field)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if (total := sum(len(s) for s in stops)) > MAX_STOP_CHARS:
            raise ValueError(f"the stop strings may hold at most {MAX_STOP_CHARS} characters in all, got {total}")
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

    def format_constraint(self) -> OutputConstraint | None:
        """The constraint `response_format` sets, where the request has one."""
        return None

    def output_constraints(self) -> list[OutputConstraint]:
        """Every constraint on the answer the request sets, `response_format`'s first (the handler takes one)."""
        fmt = self.format_constraint()
        return ([fmt] if fmt is not None else []) + self.field_constraints()

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
            speculative=self.speculative_decoding,
        )


_NOT_SUPPORTED: dict[str, str] = {
    "functions": "the legacy function calling is not supported: use 'tools'",
    "function_call": "the legacy function calling is not supported: use 'tool_choice'",
    "audio": "audio output is not supported",
    "modalities": "only ['text'] is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "insertion (fill-in-the-middle) is not supported",
}

# Values of the unsupported fields that ask for nothing beyond plain text generation.
_HARMLESS: dict[str, list[Any]] = {
    "function_call": ["none"],
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
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's: end the prompt with the assistant's header (the default), or continue the last (assistant) message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template's own variables (e.g. {"enable_thinking": false}), over the server's defaults.
    chat_template_kwargs: dict[Text, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    # Where a reasoning format applies: vLLM's include_reasoning (false: the thought is left out of the reply),
    # SGLang's separate_reasoning (false: the thought stays in the content) and stream_reasoning (false: the
    # thought is streamed in one piece when it ends). vllm-router sends all three at their defaults.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    # Known OpenAI fields this server does not implement: a 400 naming them when used.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    _unsupported = field_validator(
        "functions", "function_call", "audio", "modalities", "prediction", "web_search_options"
    )(_reject_unsupported)
    _one_ending = field_validator("continue_final_message")(one_prompt_ending)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_text(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The variables' strings reach the prompt's text: valid Unicode, as every string of a request."""
        pending: list[Any] = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str) and not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("contains invalid Unicode (a lone surrogate)") from None
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be distinct")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = {tool.function.name for tool in info.data.get("tools") or []}
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"tool_choice names the function {value.function.name!r}, which is not among 'tools'")
        if value == "required" and not names:
            raise ValueError("tool_choice 'required' needs 'tools'")
        return value

    @field_validator("response_format")
    @classmethod
    def _format_or_calls(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        choice = info.data.get("tool_choice")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and value is not None and value.constraint() is not None:
            raise ValueError("a constraining response_format cannot be combined with a tool_choice that forces a call")
        return value

    def format_constraint(self) -> OutputConstraint | None:
        return self.response_format.constraint() if self.response_format is not None else None

    def offered_tools(self) -> list[Tool]:
        """The tools the model is shown: none when tool_choice is 'none'."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

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
    response_format: ResponseFormat | None = None  # vLLM's: the constraints chat takes

    _unsupported = field_validator("suffix")(_reject_unsupported)

    def format_constraint(self) -> OutputConstraint | None:
        return self.response_format.constraint() if self.response_format is not None else None

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


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # tokens of the thought, its markers included


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's breakdown of the completion: present where the model's thought is told from its answer.
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


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
    # The thought, under vLLM's current name and its older one (which LiteLLM and others read); absent without one.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    reasoning: str | None = Field(default=None, exclude_if=lambda value: value is None)
    # Absent when the answer calls no tool, as OpenAI answers.
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda value: not value)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    # vLLM's extension: the stop string that ended the answer; absent when none did.
    stop_reason: str | None = Field(default=None, exclude_if=lambda value: value is None)


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
    reasoning_content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    reasoning: str | None = Field(default=None, exclude_if=lambda value: value is None)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda value: not value)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | None = Field(default=None, exclude_if=lambda value: value is None)


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
