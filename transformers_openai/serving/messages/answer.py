"""A chat answer as an Anthropic message: its content blocks, ids and stop reason."""

from __future__ import annotations

import json
from typing import Any

from transformers_openai.protocol import ChatCompletionResponse, Usage
from transformers_openai.protocol.messages import (
    ContentBlock,
    MessageResponse,
    MessageUsage,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolUseContent,
)


def message_id(chat_id: str) -> str:
    """`msg_` and the chat id's own part (the request's id, as the logs name it)."""
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    """`toolu_` and the chat call id's own part."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; arguments that are not one (a call cut short by
    max_tokens) give an empty object."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason_of(finish_reason: str | None, stop_string: str | None, called: bool) -> StopReason:
    """Chat's finish reason in Anthropic's terms: a stop sequence is named, a tool call is `tool_use`."""
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def message_usage(usage: Usage) -> MessageUsage:
    return MessageUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)


def message_of(completion: ChatCompletionResponse, model: str) -> MessageResponse:
    """The whole answer: its thought, its text, then its tool uses, each a block."""
    choice = completion.choices[0]
    answer = choice.message
    content: list[ContentBlock] = []
    if answer.reasoning_content:
        content.append(ThinkingContent(thinking=answer.reasoning_content))
    if answer.content:
        content.append(TextContent(text=answer.content))
    calls = answer.tool_calls or []
    for call in calls:
        content.append(
            ToolUseContent(id=tool_use_id(call.id), name=call.function.name, input=tool_input(call.function.arguments))
        )
    stop_reason = stop_reason_of(choice.finish_reason, choice.stop_reason, bool(calls))
    return MessageResponse(
        id=message_id(completion.id),
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=choice.stop_reason if stop_reason == "stop_sequence" else None,
        usage=message_usage(completion.usage),
    )
