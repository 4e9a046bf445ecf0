"""The answer's grammar after a thought: any text until the end marker, then only the schema or the forced calls,
whatever the model's logits; the marker as an added token, as a special token, or as plain text."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer

from tests.grammar_walk import random_walk
from transformers_openai.engine.request import TokenConstraint
from transformers_openai.protocol import ChatCompletionRequest
from transformers_openai.protocol.structured_outputs import OutputConstraint
from transformers_openai.serving.base import AnswerGrammar
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.chat_tools import ChatTools
from transformers_openai.serving.text.output_constraints import answer_grammar_of
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.text.thought_grammar import after_thought
from transformers_openai.serving.text.tool_formats import HERMES
from transformers_openai.serving.text.tool_parser import parse_answer
from transformers_openai.serving.tokenizer import TokenizerService

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12, "description": "where"},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
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
    }
]
THOUGHT = "Let me see.\nIf x < 3 then <b>y</b> holds; not </thi nor </think yet.\n\n"


@dataclass(frozen=True)
class Think:
    start: str = "<think>"
    end: str = "</think>"


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> Any:
    """SmolLM2's tokenizer: `<think>` and `</think>` are ordinary text there."""
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module", params=["added", "special", "text"])
def tokenizer(request: pytest.FixtureRequest, plain: Any) -> Any:
    """The markers as Qwen3 adds them (added, not special), as special tokens, or as plain text."""
    if request.param == "text":
        return plain
    changed = copy.deepcopy(plain)
    special = request.param == "special"
    changed.add_tokens([AddedToken(m, special=special) for m in ("<think>", "</think>")], special_tokens=special)
    return changed


@pytest.fixture(scope="module")
def structured(tokenizer: Any) -> StructuredOutputs:
    return StructuredOutputs(tokenizer)


def constraint(
    structured: StructuredOutputs, tokenizer: Any, grammar: AnswerGrammar, opened: bool = True
) -> TokenConstraint:
    wrapped = after_thought(grammar, Think(), TokenizerService(tokenizer), opened)
    assert wrapped.lark is not None and wrapped.param == grammar.param
    (made,) = structured.lark_constraints(wrapped.lark, 1, wrapped.param)
    return made


def allowed(made: TokenConstraint, token: int, vocab: int) -> bool:
    logits = torch.zeros(vocab)
    made.mask(logits)
    return bool(logits[token] == 0)


def feed(made: TokenConstraint, tokens: list[int], vocab: int) -> None:
    for token in tokens:
        assert allowed(made, token, vocab), token
        made.advance(token)


def end_tokens(tokenizer: Any) -> list[int]:
    """`</think>` as the model writes it: its token where there is one."""
    return list(tokenizer.encode("</think>", add_special_tokens=False))


def text(tokenizer: Any, tokens: list[int]) -> str:
    return str(tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id], skip_special_tokens=False))


def test_any_text_is_allowed_in_the_thought(structured: StructuredOutputs, tokenizer: Any) -> None:
    vocab = len(tokenizer)
    made = constraint(structured, tokenizer, AnswerGrammar("response_format", schema=SCHEMA))
    thought = tokenizer.encode(THOUGHT, add_special_tokens=False)
    assert len(thought) > 20
    feed(made, thought, vocab)
    # Not the end of the answer: it must come after the thought.
    assert not allowed(made, tokenizer.eos_token_id, vocab)
    # Ordinary words, the start of JSON, and the marker are all still open.
    for word in ("hello", "{", " \n"):
        assert allowed(made, tokenizer.encode(word, add_special_tokens=False)[0], vocab)
    feed(made, end_tokens(tokenizer), vocab)
    assert not made.is_done()


def test_after_the_marker_only_the_schema(structured: StructuredOutputs, tokenizer: Any) -> None:
    vocab = len(tokenizer)
    thought = tokenizer.encode(THOUGHT, add_special_tokens=False) + end_tokens(tokenizer)
    for seed in range(2):
        made = constraint(structured, tokenizer, AnswerGrammar("response_format", schema=SCHEMA))
        feed(made, thought, vocab)
        for word in ("hello", " {", "\n"):  # no free text, no blank: the JSON opens at once
            assert not allowed(made, tokenizer.encode(word, add_special_tokens=False)[0], vocab)
        tokens = thought + random_walk(made, vocab, seed, tokenizer.eos_token_id)
        reasoning, marker, answer = text(tokenizer, tokens).partition("</think>")
        assert marker and reasoning == THOUGHT
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_the_marker_in_ordinary_tokens_ends_the_thought(plain: Any) -> None:
    """`</` `think` `>` decode to the marker as the split reads it: the answer starts there too."""
    made = constraint(StructuredOutputs(plain), plain, AnswerGrammar("response_format", schema=SCHEMA))
    vocab = len(plain)
    pieces = plain.encode("ok</think>", add_special_tokens=False)
    assert len(pieces) > 2
    feed(made, pieces, vocab)
    assert not allowed(made, plain.encode("more", add_special_tokens=False)[0], vocab)
    tokens = pieces + random_walk(made, vocab, 0, plain.eos_token_id)
    jsonschema.validate(json.loads(text(plain, tokens).partition("</think>")[2]), SCHEMA)


def test_pieces_of_the_marker_in_a_vocabulary_that_has_its_token(plain: Any) -> None:
    added = copy.deepcopy(plain)
    added.add_tokens([AddedToken(m, special=False) for m in ("<think>", "</think>")])
    made = constraint(StructuredOutputs(added), added, AnswerGrammar("response_format", schema=SCHEMA))
    vocab = len(added)
    pieces = [added.convert_tokens_to_ids(t) for t in ("ok", "</", "think", ">")]
    assert added.decode(pieces) == "ok</think>"
    feed(made, pieces, vocab)
    assert not allowed(made, added.encode("more", add_special_tokens=False)[0], vocab)
    assert allowed(made, added.encode('{"', add_special_tokens=False)[0], vocab)


def test_a_forced_tool_call_follows_the_thought(structured: StructuredOutputs, tokenizer: Any) -> None:
    vocab = len(tokenizer)
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    )
    lark = ChatTools(TokenizerService(tokenizer), HERMES).forced_grammar(body)
    assert lark is not None
    thought = tokenizer.encode(THOUGHT, add_special_tokens=False) + end_tokens(tokenizer)
    for seed in range(2):
        made = constraint(structured, tokenizer, AnswerGrammar("tool_choice", lark=lark))
        feed(made, thought, vocab)
        tokens = thought + random_walk(made, vocab, seed, tokenizer.eos_token_id, eos_penalty=3.0)
        reasoning, _, answer = text(tokenizer, tokens).partition("</think>")
        assert reasoning == THOUGHT
        parsed = parse_answer(HERMES, answer)
        assert parsed.content is None and parsed.calls, answer
        for _, name, arguments in parsed.calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])


def test_the_opening_marker_may_come_first(structured: StructuredOutputs, tokenizer: Any) -> None:
    """A template that does not open the thought leaves `<think>` to the model."""
    vocab = len(tokenizer)
    made = constraint(structured, tokenizer, AnswerGrammar("response_format", schema=SCHEMA))
    feed(made, tokenizer.encode("<think>\nhm", add_special_tokens=False) + end_tokens(tokenizer), vocab)
    assert not allowed(made, tokenizer.encode("hm", add_special_tokens=False)[0], vocab)


def test_a_thought_the_prompt_did_not_open_is_optional(structured: StructuredOutputs, tokenizer: Any) -> None:
    """Qwen3's template leaves the thought to the model: it may open one with its first token, then answer after
    it, or answer at once; text that does not open the thought is the answer, held to the schema."""
    vocab = len(tokenizer)
    grammar = AnswerGrammar("response_format", schema=SCHEMA)
    thinking = constraint(structured, tokenizer, grammar, opened=False)
    opening = tokenizer.encode("<think>", add_special_tokens=False)
    thought = opening + tokenizer.encode(THOUGHT, add_special_tokens=False) + end_tokens(tokenizer)
    feed(thinking, thought, vocab)
    tokens = thought + random_walk(thinking, vocab, 0, tokenizer.eos_token_id)
    reasoning, marker, answer = text(tokenizer, tokens).partition("</think>")
    assert marker and reasoning == "<think>" + THOUGHT
    jsonschema.validate(json.loads(answer), SCHEMA)

    at_once = constraint(structured, tokenizer, grammar, opened=False)
    assert allowed(at_once, opening[0], vocab)
    assert not allowed(at_once, tokenizer.encode("Let", add_special_tokens=False)[0], vocab)
    brace = tokenizer.encode("{", add_special_tokens=False)
    feed(at_once, brace, vocab)  # the answer has begun: no thought can open now
    assert not allowed(at_once, opening[0], vocab)
    tokens = brace + random_walk(at_once, vocab, 1, tokenizer.eos_token_id)
    jsonschema.validate(json.loads(text(tokenizer, tokens)), SCHEMA)


def test_wrapped_grammars_are_compiled_once_and_share_annotated_variants(plain: Any) -> None:
    structured = StructuredOutputs(plain)
    tokens = TokenizerService(plain)
    annotated = {**SCHEMA, "title": "Weather", "description": "a forecast"}
    for schema in (SCHEMA, annotated, SCHEMA):
        wrapped = after_thought(AnswerGrammar("response_format", schema=schema), Think(), tokens)
        assert wrapped.lark is not None
        structured.lark_constraints(wrapped.lark, 2, wrapped.param)
    assert len(structured.cache.keys()) == 1


def test_a_schema_llguidance_refuses_is_a_400_naming_the_field(plain: Any) -> None:
    wrapped = after_thought(
        AnswerGrammar("response_format", schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        Think(),
        TokenizerService(plain),
    )
    assert wrapped.lark is not None
    with pytest.raises(BadRequestError) as caught:
        StructuredOutputs(plain).lark_constraints(wrapped.lark, 1, wrapped.param)
    assert caught.value.param == "response_format"


def test_the_size_cap_holds_after_a_thought(plain: Any) -> None:
    """A schema the cap accepts alone is accepted after a thought (the rules around it get their room); one far over
    the cap is refused before any compile, naming the field."""
    structured = StructuredOutputs(plain, max_schema_bytes=2048)
    tokens = TokenizerService(plain)

    def schema(fields: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"field_{i:03d}": {"type": "integer"} for i in range(fields)}}

    fits = schema(60)
    assert 1800 < len(json.dumps(fits, separators=(",", ":"))) <= 2048
    structured.constraints(fits, 1, "response_format")
    wrapped = after_thought(AnswerGrammar("response_format", schema=fits), Think(), tokens)
    assert wrapped.lark is not None
    structured.lark_constraints(wrapped.lark, 1, wrapped.param)
    far_over = after_thought(AnswerGrammar("response_format", schema=schema(200)), Think(), tokens)
    assert far_over.lark is not None
    kept = len(structured.cache.keys())
    with pytest.raises(BadRequestError) as caught:
        structured.lark_constraints(far_over.lark, 1, far_over.param)
    assert caught.value.param == "response_format" and caught.value.code == "schema_too_large"
    assert len(structured.cache.keys()) == kept


def test_a_format_without_an_end_marker_leaves_the_grammar_as_it_is(plain: Any) -> None:
    grammar = AnswerGrammar("response_format", schema=SCHEMA)
    assert after_thought(grammar, Think(end=""), TokenizerService(plain)) is grammar


def test_choice_regex_and_grammar_follow_the_thought(plain: Any) -> None:
    """The new forms nest after a thought as a schema does: free text until the marker, then only the answer (the
    wrapper is the schemas', tested above with each kind of marker; here with the marker as text)."""
    structured, vocab = StructuredOutputs(plain), len(plain)
    forms = [
        (OutputConstraint("choice", ["yes", "no", "maybe so"], "structured_outputs.choice"), r"yes|no|maybe so"),
        (OutputConstraint("regex", r"[0-9]{3}-[a-z]{2}", "structured_outputs.regex"), r"[0-9]{3}-[a-z]{2}"),
        (OutputConstraint("grammar", 'root ::= [0-9] ("," [0-9]){0,3}', "grammar"), r"[0-9](,[0-9]){0,3}"),
    ]
    thought = plain.encode(THOUGHT, add_special_tokens=False) + end_tokens(plain)
    for form, pattern in forms:
        grammar = answer_grammar_of([form])
        assert grammar is not None and grammar.what
        made = constraint(structured, plain, grammar)
        feed(made, thought, vocab)
        assert not allowed(made, plain.encode("hello", add_special_tokens=False)[0], vocab)
        tokens = thought + random_walk(made, vocab, 0, plain.eos_token_id, eos_penalty=2.0)
        reasoning, marker, answer = text(plain, tokens).partition("</think>")
        assert marker and reasoning == THOUGHT
        assert re.fullmatch(pattern, answer), (form.kind, answer)
