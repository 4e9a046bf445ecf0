"""Tool calling in chat: the tools the template shows, the grammar of a forced call, the calls read back."""

from __future__ import annotations

import json
from typing import Any

from transformers_openai.protocol import ChatCompletionRequest
from transformers_openai.protocol.tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.tool_formats import ToolFormat, calls_schema
from transformers_openai.serving.text.tool_parser import (
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ParsedAnswer,
    ToolEvent,
)
from transformers_openai.serving.tokenizer import TokenizerService


class ChatTools:
    """One served model's tool calling: its tokenizer's template and the format its calls are written in."""

    def __init__(self, tokenizer: TokenizerService, tool_format: ToolFormat) -> None:
        self.format = tool_format
        # Read once here: the template and the vocabulary do not change, and requests must not wait for them.
        self._takes_tools = tokenizer.takes_tools()
        markers = [marker for marker in (tool_format.start, tool_format.end, tool_format.tag) if marker]
        tokens = {marker: tokenizer.added_token(marker) for marker in markers}
        # A marker that is an added token is forced by its id: a text literal would never match it.
        self._literals = {m: f"<[{t[0]}]>" if t is not None else json.dumps(m) for m, t in tokens.items()}
        # Special markers must survive decoding for the parser to see them.
        self.keeps_markers = any(token is not None and token[1] for token in tokens.values())

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]] | None:
        """The tools offered, as the chat template takes them; a 400 when the template cannot show them to the model."""
        if not tools:
            return None
        if not self._takes_tools:
            raise BadRequestError(
                "this model's chat template does not show tools to the model; start the server with "
                "--chat-template FILE of a template that does",
                param="tools",
            )
        return [tool.model_dump(exclude_none=True) for tool in tools]

    def forced_grammar(self, request: ChatCompletionRequest) -> str | None:
        """A Lark grammar when tool_choice requires a call ('required': any tool, a named one: that tool)."""
        choice = request.tool_choice
        tools = request.offered_tools()
        if isinstance(choice, NamedToolChoice):
            tools = [tool for tool in tools if tool.function.name == choice.function.name]
        elif choice != "required":
            return None
        schema = calls_schema(
            [(tool.function.name, tool.function.arguments_schema()) for tool in tools], self.format.arguments_key
        )
        many = choice == "required" and request.parallel_tool_calls is not False
        return self.format.grammar(schema, many, self._literals.__getitem__)


def tool_calls(parsed: ParsedAnswer) -> list[ToolCall]:
    return [ToolCall(id=i, function=FunctionCall(name=name, arguments=args)) for i, name, args in parsed.calls]


def delta_parts(events: list[ToolEvent]) -> tuple[str, list[DeltaToolCall]]:
    """A chunk's content and its tool-call pieces: a call's first piece has its id and name, then arguments."""
    content = "".join(event.text for event in events if isinstance(event, ContentDelta))
    calls: list[DeltaToolCall] = []
    for event in events:
        if isinstance(event, CallStarted):
            function = DeltaFunctionCall(name=event.name, arguments="")
            calls.append(DeltaToolCall(index=event.index, id=event.id, type="function", function=function))
        elif isinstance(event, ArgumentsDelta):
            if calls and calls[-1].index == event.index:
                calls[-1].function.arguments = (calls[-1].function.arguments or "") + event.text
            else:
                calls.append(DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text)))
    return content, calls
