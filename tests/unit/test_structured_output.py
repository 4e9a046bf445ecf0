"""Structured outputs with llguidance: whatever the model's logits, the grammar's mask leads to a valid answer."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from tests.grammar_walk import random_walk
from tests.schemas import SCHEMAS
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.structured_output import StructuredOutputs


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer)


def walk(structured: StructuredOutputs, tokenizer, schema: dict, seed: int, vocab_pad: int = 0) -> str:
    """Random logits every step, masked by the grammar, argmax taken: a model that knows nothing about JSON."""
    (constraint,) = structured.constraints(schema, 1, "response_format")
    tokens = random_walk(constraint, len(tokenizer) + vocab_pad, seed, tokenizer.eos_token_id)
    return tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id])


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_logits_under_the_grammar_always_give_a_valid_answer(structured, tokenizer, index: int) -> None:
    schema = SCHEMAS[index]
    for seed in range(3):
        text = walk(structured, tokenizer, schema, seed)
        jsonschema.validate(json.loads(text), schema)


def test_logits_past_the_tokenizer_vocabulary_are_masked(structured, tokenizer) -> None:
    """Models often pad their vocabulary (e.g. to a multiple of 64): those ids are never allowed."""
    text = walk(structured, tokenizer, SCHEMAS[0], seed=5, vocab_pad=64)
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_json_object_accepts_any_object(structured, tokenizer) -> None:
    schema = {"type": "object"}
    (constraint,) = structured.constraints(schema, 1, "response_format")
    logits = torch.zeros(len(tokenizer))
    constraint.mask(logits)
    allowed = [tokenizer.decode([t]) for t in torch.nonzero(logits > float("-inf")).flatten().tolist()]
    assert allowed and all(text.lstrip().startswith("{") for text in allowed)


@pytest.mark.parametrize(
    ("schema", "needle"),
    [({"type": "nonsense"}, "nonsense"), ({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}, "")],
)
def test_a_schema_llguidance_cannot_take_is_a_400_naming_the_field(structured, schema: dict, needle: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        structured.constraints(schema, 1, "response_format")
    assert caught.value.param == "response_format"
    assert "JSON schema" in str(caught.value) and needle in str(caught.value)


def test_each_schema_is_compiled_once(structured, monkeypatch) -> None:
    from llguidance import LLMatcher

    calls = []
    real = LLMatcher.grammar_from_json_schema

    def counting(schema, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(schema)
        return real(schema, **kwargs)

    monkeypatch.setattr(LLMatcher, "grammar_from_json_schema", counting)
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}
    first = structured.constraints(schema, 2, "response_format")
    second = structured.constraints(dict(reversed(list(schema.items()))), 3, "response_format")
    assert len(first) == 2 and len(second) == 3 and len(calls) == 1
    assert first[0] is not first[1]  # each choice has its own state
