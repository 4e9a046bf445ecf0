"""Ten JSON schemas for structured-output tests: nested objects, arrays, enums, required fields, bounds.

Strings, numbers and arrays are bounded, so that even random tokens under the grammar end in a finished answer.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": SMALL_INT},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": NAME},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"first": NAME, "last": NAME},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "score": SMALL_INT,
        },
        "required": ["person", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "qty": SMALL_INT},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"type": "string", "enum": ["low", "medium", "high"]}, "count": SMALL_INT},
        "required": ["level", "count"],
        "additionalProperties": False,
    },
    {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"answer": NAME, "confidence_percent": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["answer", "confidence_percent"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "weather": {"enum": ["sunny", "rainy"]},
            "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3},
        },
        "required": ["city", "weather", "days"],
        "additionalProperties": False,
    },
]

# A grammar cheap to start (its first masks pass the compile's check) whose `code` costs 5-7 ms of CPU a mask once
# the answer reaches it (15,000 lexer states, within the limit of 20,000): rows following it end mid-answer when
# they pass the mask budget.
COSTLY: dict[str, Any] = {
    "type": "object",
    "properties": {"note": {"type": "string", "maxLength": 8}, "code": {"type": "string", "pattern": "^x{15000}$"}},
    "required": ["note", "code"],
    "additionalProperties": False,
}
