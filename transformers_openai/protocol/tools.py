"""Tool calling on the wire: the tools a request offers, its tool_choice, and the calls an answer makes."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from transformers_openai.protocol.base import Strict, Text, Tolerant


def _function_name(value: str) -> str:
    if not value or len(value) > 64 or not all(c.isascii() and (c.isalnum() or c in "_-") for c in value):
        raise ValueError(f"function names are 1 to 64 letters, digits, '_' or '-', got {value!r}")
    return value


FunctionName = Annotated[Text, AfterValidator(_function_name)]


class FunctionDefinition(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means no arguments
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "additionalProperties": False}


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---------------------------------------------------------------- calls in a conversation's history


class HistoryFunctionCall(Tolerant):
    name: Text
    arguments: Text  # JSON text, as the API returned it

    def arguments_value(self) -> Any:
        """The arguments as the chat templates want them: the decoded object, or the text when it is not JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


class HistoryToolCall(Tolerant):
    id: Text
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


# ---------------------------------------------------------------- calls in answers


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    # Absent rather than null when a chunk does not carry it, as OpenAI streams them.
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, exclude_if=lambda value: value is None)
    arguments: str | None = Field(default=None, exclude_if=lambda value: value is None)


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = Field(default=None, exclude_if=lambda value: value is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda value: value is None)
    function: DeltaFunctionCall
