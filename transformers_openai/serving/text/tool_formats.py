"""How models write tool calls: one entry per format, detected from the chat template or named by a flag.

Each format says where calls begin and end and what its JSON calls the arguments; from that come both the
parser (`tool_parser`) and the grammar that forces a call when `tool_choice` requires one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str | None  # the marker before a call (Hermes) or before all of them (Mistral); None: the JSON opens
    end: str | None  # the marker after each call
    arguments_key: str
    array: bool = False  # the calls are one JSON array after the start marker (Mistral)
    tag: str | None = None  # without a start marker: a tag the answer may open with (Llama's <|python_tag|>)
    between: str = "\n"  # what separates calls in a forced answer
    detect: tuple[str, ...] = ()  # text in a chat template that says the model writes this format

    def grammar(self, calls_schema: dict[str, Any], many: bool, literal: Callable[[str], str]) -> str:
        """A Lark grammar (llguidance's dialect) for answers that are only calls, each following `calls_schema`.

        `literal` writes a marker as the grammar must match it (a special token by its id, other text quoted).
        `many`: up to 16 calls (parallel_tool_calls), else exactly one.
        """
        call = "call: %json " + json.dumps(calls_schema)
        if self.array:  # the marker, then one JSON array of calls
            items = 'call ("," call){0,15}' if many else "call"
            return f'start: {literal(self.start or "")} "[" {items} "]"\n{call}'
        parts = [literal(self.start), r'"\n"'] if self.start else []
        parts.append("call")
        parts += [r'"\n"', literal(self.end)] if self.end else []
        repeat = f" ({json.dumps(self.between)} one){{0,15}}" if many else ""
        return f"start: one{repeat}\none: {' '.join(parts)}\n{call}"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", detect=("<tool_call>",))
LLAMA3_JSON = ToolFormat(
    "llama3_json", None, None, "parameters", tag="<|python_tag|>", between="; ", detect=("<|python_tag|>",)
)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, "arguments", array=True, detect=("[TOOL_CALLS]",))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect_format(template: str) -> ToolFormat:
    """The format a chat template teaches its model; Hermes (the most common) when it does not say."""
    for tool_format in FORMATS.values():
        if any(marker in template for marker in tool_format.detect):
            return tool_format
    return HERMES


def calls_schema(tools: list[tuple[str, dict[str, Any]]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call to any of `tools` (name, arguments schema), compact as llguidance writes it."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for name, parameters in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}
