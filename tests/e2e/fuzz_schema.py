"""Schemathesis against our own /openapi.json, with `model` pinned to the served name (else every case is a 404)."""

from __future__ import annotations

import os
from typing import Any

import schemathesis


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
