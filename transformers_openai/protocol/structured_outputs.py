"""Constraints on the answer beyond `response_format`: vLLM's `structured_outputs` field (`choice`, `regex`,
`grammar`, `json`, `json_object`) and its older `guided_*` fields, SGLang's `regex` and `ebnf`, llama.cpp's `grammar`
and `json_schema`. Each field that is set names one constraint; the serving layer takes one at most per request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from transformers_openai.protocol.base import Strict, Text

ConstraintKind = Literal["choice", "regex", "grammar", "json"]


@dataclass(frozen=True)
class OutputConstraint:
    """One constraint a request sets: what kind, its value and the field that set it (named in a 400)."""

    kind: ConstraintKind
    value: Any  # choice: list[str]; regex, grammar: str; json: a JSON schema (dict)
    param: str


def json_schema_value(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """A JSON schema given as an object or as its JSON text (vLLM and SGLang take both): the object."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        raise ValueError("must be a JSON schema: an object, or its JSON text") from None
    if not isinstance(parsed, dict):
        raise ValueError("must be a JSON schema: an object, or its JSON text")
    return parsed


class StructuredOutputsParams(Strict):
    """vLLM's `structured_outputs`: one of `choice`, `regex`, `grammar` (Lark, or GBNF as llama.cpp writes it),
    `json` (a schema) or `json_object`."""

    choice: list[Text] | None = Field(None, min_length=1)
    regex: Text | None = None
    grammar: Text | None = None
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    json_object: bool | None = None

    _json_text = field_validator("json_")(json_schema_value)

    def constraints(self) -> list[OutputConstraint]:
        found: list[OutputConstraint] = []
        for kind, value in (("choice", self.choice), ("regex", self.regex), ("grammar", self.grammar)):
            if value is not None:
                found.append(OutputConstraint(kind, value, f"structured_outputs.{kind}"))  # type: ignore[arg-type]
        if self.json_ is not None:
            found.append(OutputConstraint("json", self.json_, "structured_outputs.json"))
        if self.json_object:
            found.append(OutputConstraint("json", {"type": "object"}, "structured_outputs.json_object"))
        return found


class ConstraintFields(Strict):
    """The request fields that set a constraint outside `response_format`, shared by chat and completions."""

    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's names before `structured_outputs` (removed there in 0.12; clients still send them)
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_regex: Text | None = None
    guided_grammar: Text | None = None
    guided_json: dict[str, Any] | Text | None = None
    # SGLang's
    regex: Text | None = None
    ebnf: Text | None = None
    # llama.cpp's
    grammar: Text | None = None
    json_schema: dict[str, Any] | Text | None = None

    _json_text = field_validator("guided_json", "json_schema")(json_schema_value)

    def field_constraints(self) -> list[OutputConstraint]:
        """Every constraint these fields set, in the order of the fields."""
        found = self.structured_outputs.constraints() if self.structured_outputs is not None else []
        fields: list[tuple[ConstraintKind, str]] = [
            ("choice", "guided_choice"),
            ("regex", "guided_regex"),
            ("grammar", "guided_grammar"),
            ("json", "guided_json"),
            ("regex", "regex"),
            ("grammar", "ebnf"),
            ("grammar", "grammar"),
            ("json", "json_schema"),
        ]
        for kind, name in fields:
            value = getattr(self, name)
            if value is not None:
                found.append(OutputConstraint(kind, value, name))
        return found
