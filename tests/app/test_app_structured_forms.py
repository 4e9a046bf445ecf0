"""Structured outputs beyond JSON through the app (scripted engine, the tiny tokenizer): every form of vLLM, SGLang,
llama.cpp and the response_format variants reaches the engine as a grammar that holds whatever the model's logits
(a random walk under its masks gives only matching answers), for chat, completions and Responses; every bad
constraint is a 400 naming its field before anything reaches the engine."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import (
    CHAT,
    COMPLETIONS,
    assert_error,
    chat_body,
    completion_body,
    make_app,
    make_context,
    running,
)
from tests.grammar_walk import random_walk
from transformers_openai.engine.request import TokenConstraint
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.tokenizer import TokenizerService

RESPONSES = "/v1/responses"
TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-tools.jinja"
CHOICES = ["positive", "negative", 'neutral "as such"', "ünïcode 😀"]
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
# A list of one to five digits separated by commas, as GBNF and as Lark; the regex that says the same.
GBNF = 'root ::= digit ("," digit){0,4}\ndigit ::= [0-9]'
LARK = 'start: item ("," item){0,2}\nitem: "red" | "green" | "blue"'
DIGITS = r"[0-9](,[0-9]){0,4}"
COLOURS = r"(red|green|blue)(,(red|green|blue)){0,2}"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def matches(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


def follows_schema(schema: dict[str, Any]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    return check


# (name, request fields, what every answer must satisfy)
FORMS: list[tuple[str, dict[str, Any], Callable[[str], bool]]] = [
    ("structured_outputs choice", {"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ("structured_outputs regex", {"structured_outputs": {"regex": DATE}}, matches(DATE)),
    ("structured_outputs anchored regex", {"structured_outputs": {"regex": f"^{DATE}$"}}, matches(DATE)),
    ("structured_outputs Lark", {"structured_outputs": {"grammar": LARK}}, matches(COLOURS)),
    ("structured_outputs GBNF", {"structured_outputs": {"grammar": GBNF}}, matches(DIGITS)),
    ("structured_outputs json", {"structured_outputs": {"json": SCHEMA}}, follows_schema(SCHEMA)),
    ("structured_outputs json text", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, follows_schema(SCHEMA)),
    (
        "structured_outputs json_object",
        {"structured_outputs": {"json_object": True}},
        follows_schema({"type": "object"}),
    ),
    ("guided_choice", {"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ("guided_regex", {"guided_regex": DATE}, matches(DATE)),
    ("guided_grammar", {"guided_grammar": GBNF}, matches(DIGITS)),
    ("guided_json", {"guided_json": SCHEMA}, follows_schema(SCHEMA)),
    ("SGLang regex", {"regex": DATE}, matches(DATE)),
    ("SGLang ebnf", {"ebnf": GBNF}, matches(DIGITS)),
    ("llama.cpp grammar", {"grammar": GBNF}, matches(DIGITS)),
    ("llama.cpp json_schema", {"json_schema": SCHEMA}, follows_schema(SCHEMA)),
    ("response_format grammar", {"response_format": {"type": "grammar", "grammar": LARK}}, matches(COLOURS)),
    ("response_format regex", {"response_format": {"type": "regex", "value": DATE}}, matches(DATE)),
]


@pytest.fixture
async def structured_client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    tokenizer = copy.deepcopy(hf_tokenizer)
    context = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, TEMPLATE.read_text()),  # shows tools, for the forced-call case
        structured=StructuredOutputs(tokenizer),
        max_model_len=2048,
    )
    async with running(make_app(fake, tokenizer, loader=lambda: context)) as ready:
        yield ready


def walked(constraint: TokenConstraint | None, tokenizer: Any, seed: int) -> str:
    """The answer a model that knows nothing of the grammar gives under its masks."""
    assert constraint is not None
    tokens = random_walk(constraint, len(tokenizer), seed, tokenizer.eos_token_id, eos_penalty=2.0)
    return str(tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id]))


async def test_every_form_reaches_the_engine_as_a_grammar_that_holds(
    structured_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    """Chat and completions, two choices each (two walks); then Responses' one form, streamed and not."""
    for name, fields, check in FORMS:
        for path, make_body in ((CHAT, chat_body), (COMPLETIONS, completion_body)):
            fake.submitted.clear()
            response = await structured_client.post(path, json=make_body(n=2, max_tokens=40, **fields))
            assert response.status_code == 200, (name, path, response.text)
            answers = [walked(r.constraint, hf_tokenizer, seed) for seed, r in enumerate(fake.submitted)]
            assert len(answers) == 2 and all(check(a) for a in answers), (name, path, answers)
    for name, fields, check in FORMS[:5]:
        for stream in (False, True):
            fake.submitted.clear()
            request = {"model": "fake-model", "input": "hi", "stream": stream, **fields}
            response = await structured_client.post(RESPONSES, json=request)
            assert response.status_code == 200, (name, response.text)
            assert check(walked(fake.submitted[0].constraint, hf_tokenizer, 0)), name


BAD: list[tuple[str, str, dict[str, Any], str, str]] = [
    # (case, path, request fields, the param named, a word of the message)
    ("unclosed class", CHAT, {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "regex"),
    ("look-around", COMPLETIONS, {"guided_regex": "(?=a)a"}, "guided_regex", "look-around"),
    ("regex past the lexer's limits", CHAT, {"regex": "x{50000}"}, "regex", "regex"),
    (
        "regex of a bad class",
        COMPLETIONS,
        {"response_format": {"type": "regex", "value": "[z-a]"}},
        "response_format.value",
        "regex",
    ),
    (
        "Lark naming no rule",
        CHAT,
        {"structured_outputs": {"grammar": "start: foo"}},
        "structured_outputs.grammar",
        "foo",
    ),
    ("GBNF cut short", CHAT, {"grammar": "root ::= [0-9"}, "grammar", "GBNF"),
    ("GBNF without root", COMPLETIONS, {"ebnf": 'answer ::= "a"'}, "ebnf", "root"),
    ("neither", CHAT, {"guided_grammar": "just words"}, "guided_grammar", "Lark"),
    ("GBNF nested too deep", CHAT, {"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "grammar", "grammar"),
    (
        "empty Lark",
        CHAT,
        {"response_format": {"type": "grammar", "grammar": "%llguidance {}"}},
        "response_format.grammar",
        "grammar",
    ),
    (
        "a schema llguidance refuses",
        CHAT,
        {"structured_outputs": {"json": {"type": "nonsense"}}},
        "structured_outputs.json",
        "nonsense",
    ),
    (
        "two fields",
        CHAT,
        {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
        "guided_choice",
        "structured_outputs.regex",
    ),
    (
        "two in structured_outputs",
        COMPLETIONS,
        {"structured_outputs": {"choice": ["a"], "grammar": GBNF}},
        "structured_outputs.grammar",
        "structured_outputs.choice",
    ),
    (
        "response_format and a field",
        COMPLETIONS,
        {"response_format": {"type": "json_object"}, "regex": "a"},
        "regex",
        "response_format",
    ),
    (
        "a forced call and a regex",
        CHAT,
        {"tools": [TOOL], "tool_choice": "required", "regex": "a"},
        "regex",
        "tool_choice",
    ),
]


async def test_a_bad_constraint_is_a_400_naming_it_before_the_engine(
    structured_client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    for case, path, fields, param, word in BAD:
        body = chat_body(**fields) if path == CHAT else completion_body(**fields)
        response = await structured_client.post(path, json=body)
        try:
            error = assert_error(response, 400, param=param)
            assert word in error["message"], error
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
    # Responses: its own field names in the 400
    base = {"model": "fake-model", "input": "hi"}
    bad = {**base, "structured_outputs": {"regex": "(unclosed"}}
    assert_error(await structured_client.post(RESPONSES, json=bad), 400, param="structured_outputs.regex")
    both = {**base, "structured_outputs": {"choice": ["a"]}, "text": {"format": {"type": "json_object"}}}
    error = assert_error(await structured_client.post(RESPONSES, json=both), 400, param="structured_outputs.choice")
    assert "'text.format'" in error["message"] and error["code"] == "conflicting_constraints"
    assert fake.submitted == []
