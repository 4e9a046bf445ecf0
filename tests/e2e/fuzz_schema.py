"""Schemathesis against our own /openapi.json, with `model` pinned to the served name (else every case is a 404)."""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

from tests.schemas import COSTLY


def pin_model(raw: dict[str, Any], model: str) -> dict[str, Any]:
    """Every request body's `model` property becomes the served model's name; everything else stays free."""
    for schema in raw.get("components", {}).get("schemas", {}).values():
        properties = schema.get("properties", {})
        if "model" in properties and "model" in schema.get("required", []):
            properties["model"] = {"type": "string", "const": model}
    return raw


@schemathesis.hook
def before_load_schema(context: schemathesis.HookContext, raw_schema: dict[str, Any]) -> None:
    """For `st run` (SCHEMATHESIS_HOOKS=tests.e2e.fuzz_schema): pins the model named by FUZZ_MODEL."""
    pin_model(raw_schema, os.environ.get("FUZZ_MODEL", "test-model"))


def nasty_schemas() -> dict[str, dict[str, Any]]:
    """response_format schemas that must each get a 400 or an answer, never a 5xx or a stalled server: over the size
    cap, past llguidance's limits, costly to follow, nested past its recursion limit, broken, or only annotated."""
    annotated = {
        "title": "Person",
        "description": "someone",
        "$comment": "v1",
        "examples": [{"name": "Ann"}],
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8, "description": "their name", "title": "Name"},
            "title": {"enum": ["dr", "mr", "ms"], "description": "a property called title"},
        },
        "required": ["name", "title"],
        "additionalProperties": False,
    }
    return {
        "over the size cap": {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}},
        "enum over the size cap": {"enum": [f"value number {i}" for i in range(5000)]},
        "past the lexer's limits": {"type": "string", "pattern": "^x{50000}$"},
        "costly from the first token": {"type": "string", "pattern": "^x{20000}$"},
        "costly mid-answer": COSTLY,
        "nested past the recursion limit": json.loads(
            '{"type":"object","properties":{"a":' * 300 + '{"type":"integer"}' + "}}" * 300
        ),
        "a reference to nothing": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        "an unknown type": {"type": "nonsense"},
        "a bad pattern": {"type": "string", "pattern": "^(unclosed$"},
        "many items required": {"type": "array", "items": {"type": "integer"}, "minItems": 2000},
        "only annotated": annotated,
        "empty": {},
    }
