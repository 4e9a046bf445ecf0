"""An Anthropic Messages request as the chat request the chat handler runs: the one path for templating, sampling,
tools, structured output and reasoning."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from transformers_openai.protocol import ChatCompletionRequest, StreamOptions
from transformers_openai.protocol.messages import (
    AnyChoice,
    CountTokensRequest,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    NamedChoice,
    NoneChoice,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.template_variables import BOOLEAN_VARIABLES

# Anthropic's efforts above "high" are the most a chat template's reasoning_effort says.
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def chat_request_of(request: CountTokensRequest, reasons: bool) -> ChatCompletionRequest:
    """The chat request that runs `request` (a MessagesRequest) or renders its prompt (a CountTokensRequest).

    `reasons`: the served model has a reasoning format, so `thinking` switches its template's thinking and its thought
    comes back as thinking blocks; without one, `thinking` changes nothing.
    """
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        **_tool_fields(request),
        **_thinking_fields(request, reasons),
    }
    if request.messages[-1].role == "assistant":  # Anthropic's prefill: the answer continues the last turn
        fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if request.output_config is not None and request.output_config.format is not None:
        schema = request.output_config.format.schema_
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if isinstance(request, MessagesRequest):
        fields |= _sampling_fields(request)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"][:1])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise BadRequestError(f"{field}: {message}" if field else message, param=field or None) from None


def _sampling_fields(request: MessagesRequest) -> dict[str, Any]:
    stream = {"include_usage": True, "continuous_usage_stats": True}  # the message_start event has the input tokens
    return {
        "max_tokens": request.max_tokens,
        "stop": request.stop_sequences or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "user": request.metadata.user_id if request.metadata else None,
        "stream": request.stream,
        "stream_options": StreamOptions(**stream) if request.stream else None,
    }


def _tool_fields(request: CountTokensRequest) -> dict[str, Any]:
    tools = [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.input_schema},
        }
        for tool in request.tools or []
    ]
    fields: dict[str, Any] = {"tools": tools or None}
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = _chat_tool_choice(choice)
        if not isinstance(choice, NoneChoice) and choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _chat_tool_choice(choice: ToolChoice) -> Any:
    if isinstance(choice, NamedChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AnyChoice):
        return "required"
    return choice.type  # "auto" and "none" are chat's names too


def _thinking_fields(request: CountTokensRequest, reasons: bool) -> dict[str, Any]:
    if not reasons:
        return {}
    fields: dict[str, Any] = {}
    if request.thinking is not None:
        on = request.thinking.type != "disabled"
        fields["chat_template_kwargs"] = dict.fromkeys(BOOLEAN_VARIABLES, on)
        fields["include_reasoning"] = on
    effort = request.output_config.effort if request.output_config else None
    if effort is not None:
        fields["reasoning_effort"] = _EFFORTS[effort]
    return fields


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first; a user turn's tool results as tool messages
    (before its other content: they answer the turn before); an assistant turn's tool uses as its tool calls."""
    system = request.system_text()
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    last = len(request.messages) - 1
    for index, message in enumerate(request.messages):
        if not message.blocks():
            raise BadRequestError(f"messages.{index}.content: a message needs content", param=f"messages.{index}")
        if message.role == "user":
            messages.extend(_user_messages(message))
        else:
            messages.append(_assistant_message(message, index, index == last))
    return messages


def _user_messages(message: InputMessage) -> list[dict[str, Any]]:
    blocks = message.blocks()
    results = [
        {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
        for block in blocks
        if isinstance(block, ToolResultBlock)
    ]
    texts = [block.text for block in blocks if isinstance(block, TextBlock)]
    images = [block for block in blocks if isinstance(block, ImageBlock)]
    if not texts and not images:
        return results
    if not images:
        return [*results, {"role": "user", "content": "\n".join(texts)}]
    parts = [
        {"type": "text", "text": block.text}
        if isinstance(block, TextBlock)
        else {"type": "image_url", "image_url": {"url": block.url()}}
        for block in blocks
        if isinstance(block, TextBlock | ImageBlock)
    ]
    return [*results, {"role": "user", "content": parts}]


def _assistant_message(message: InputMessage, index: int, last: bool) -> dict[str, Any]:
    blocks = message.blocks()
    calls = [
        {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    if calls and last:
        raise BadRequestError(
            f"messages.{index}: the conversation ends with tool_use blocks; give their tool_result blocks in a "
            "user message after it",
            param=f"messages.{index}",
        )
    chat: dict[str, Any] = {
        "role": "assistant",
        "content": "\n".join(block.text for block in blocks if isinstance(block, TextBlock)),
        "tool_calls": calls or None,
    }
    thoughts = [block.thinking for block in blocks if isinstance(block, ThinkingBlock)]
    if thoughts:
        chat["reasoning_content"] = "\n".join(thoughts)
    return chat
