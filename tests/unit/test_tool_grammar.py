"""Forced tool calls: whatever the model's logits, the grammar of tool_choice leads to calls the parser reads,
to the tools allowed, with arguments valid against their schemas; in every format, markers as text or as tokens."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from tests.grammar_walk import random_walk
from transformers_openai.protocol import ChatCompletionRequest
from transformers_openai.serving.text.chat_tools import ChatTools
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.text.tool_formats import FORMATS, HERMES, ToolFormat
from transformers_openai.serving.text.tool_parser import parse_answer
from transformers_openai.serving.tokenizer import TokenizerService

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "numbers": {"type": "array", "items": {"type": "integer", "maximum": 999}, "maxItems": 4}
                },
                "required": ["numbers"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: no arguments
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def structured(tokenizer: Any) -> StructuredOutputs:
    return StructuredOutputs(tokenizer)


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    return ChatCompletionRequest.model_validate(body)


def walk(
    structured: StructuredOutputs, tokenizer: Any, tool_format: ToolFormat, body: ChatCompletionRequest, seed: int
) -> str:
    """Random logits every step, masked by the grammar, argmax taken: a model that knows nothing of tools."""
    tools = ChatTools(TokenizerService(tokenizer), tool_format)
    grammar = tools.forced_grammar(body)
    assert grammar is not None
    (constraint,) = structured.lark_constraints(grammar, 1, "tool_choice")
    # A lowered end token lets the walks make several calls now and then.
    tokens = random_walk(constraint, len(tokenizer), seed, tokenizer.eos_token_id, eos_penalty=3.0)
    skip = not tools.keeps_markers
    return str(tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id], skip_special_tokens=skip))


@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_required_gives_valid_calls_to_the_tools(
    structured: StructuredOutputs, tokenizer: Any, format_name: str
) -> None:
    tool_format = FORMATS[format_name]
    counts = set()
    for seed in range(6):
        text = walk(structured, tokenizer, tool_format, request(tool_choice="required"), seed)
        answer = parse_answer(tool_format, text)
        assert answer.content is None, text
        assert answer.calls, text
        counts.add(len(answer.calls))
        for _, name, arguments in answer.calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert max(counts) > 1  # parallel calls are allowed by default


@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_a_named_choice_gives_exactly_one_call_to_that_tool(
    structured: StructuredOutputs, tokenizer: Any, format_name: str
) -> None:
    tool_format = FORMATS[format_name]
    for seed in range(4):
        choice = {"type": "function", "function": {"name": "add"}}
        answer = parse_answer(tool_format, walk(structured, tokenizer, tool_format, request(tool_choice=choice), seed))
        [(_, name, arguments)] = answer.calls
        assert name == "add"
        jsonschema.validate(json.loads(arguments), SCHEMAS["add"])


def test_parallel_tool_calls_false_gives_one_call(structured: StructuredOutputs, tokenizer: Any) -> None:
    for seed in range(6):
        text = walk(structured, tokenizer, HERMES, request(tool_choice="required", parallel_tool_calls=False), seed)
        assert len(parse_answer(HERMES, text).calls) == 1


def test_markers_that_are_special_tokens_are_forced_as_those_tokens(tokenizer: Any) -> None:
    """Qwen-like vocabularies make <tool_call> one token: a text literal could never match it."""
    special = copy.deepcopy(tokenizer)
    special.add_tokens([AddedToken(m, special=True) for m in ("<tool_call>", "</tool_call>")], special_tokens=True)
    tools = ChatTools(TokenizerService(special), HERMES)
    assert tools.keeps_markers
    start_id = special.convert_tokens_to_ids("<tool_call>")
    assert f"<[{start_id}]>" in (tools.forced_grammar(request(tool_choice="required")) or "")
    structured = StructuredOutputs(special)
    for seed in range(3):
        text = walk(structured, special, HERMES, request(tool_choice="required"), seed)
        assert text.startswith("<tool_call>")
        assert parse_answer(HERMES, text).calls


def test_auto_and_none_force_nothing(tokenizer: Any) -> None:
    tools = ChatTools(TokenizerService(tokenizer), HERMES)
    assert tools.forced_grammar(request(tool_choice="auto")) is None
    assert tools.forced_grammar(request()) is None
    assert tools.forced_grammar(request(tool_choice="none")) is None
