"""Structured outputs with llguidance: whatever the model's logits, the grammar's mask leads to a valid answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from numpy.typing import NDArray
from transformers import AutoTokenizer

from tests.e2e.fuzz_schema import nasty_schemas
from tests.grammar_walk import random_walk
from tests.schemas import COSTLY, SCHEMAS
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.structured_output import ANNOTATIONS, StructuredOutputs


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer)


def walk(structured: StructuredOutputs, tokenizer, schema: dict[str, Any], seed: int, vocab_pad: int = 0) -> str:
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
def test_a_schema_llguidance_cannot_take_is_a_400_naming_the_field(
    structured, schema: dict[str, Any], needle: str
) -> None:
    with pytest.raises(BadRequestError) as caught:
        structured.constraints(schema, 1, "response_format")
    assert caught.value.param == "response_format"
    assert "JSON schema" in str(caught.value) and needle in str(caught.value)


def test_each_schema_is_compiled_once(structured, monkeypatch) -> None:
    from llguidance import LLMatcher

    calls = []
    real = LLMatcher.grammar_from_json_schema

    def counting(schema: dict[str, Any], **kwargs: Any) -> str:
        calls.append(schema)
        return real(schema, **kwargs)

    monkeypatch.setattr(LLMatcher, "grammar_from_json_schema", counting)
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}
    first = structured.constraints(schema, 2, "response_format")
    second = structured.constraints(dict(reversed(list(schema.items()))), 3, "response_format")
    assert len(first) == 2 and len(second) == 3 and len(calls) == 1
    assert first[0] is not first[1]  # each choice has its own state


# -- hardening: size cap, annotations, cache bytes, llguidance's limits, mask budget


def object_schema(fields: int, tag: str) -> dict[str, Any]:
    properties = {f"{tag}_{i}": {"type": "string", "maxLength": 10 + i} for i in range(fields)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def test_a_schema_over_the_size_cap_is_a_400_naming_the_limit(tokenizer) -> None:
    structured = StructuredOutputs(tokenizer, max_schema_bytes=2048)
    schema = object_schema(60, "big")
    with pytest.raises(BadRequestError) as caught:
        structured.constraints(schema, 1, "response_format")
    error = caught.value
    assert error.status_code == 400 and error.param == "response_format" and error.code == "schema_too_large"
    assert "2,048" in error.message and "--max-schema-bytes" in error.message
    with pytest.raises(BadRequestError) as caught:
        structured.lark_constraints("start: " + " | ".join(f'"{i}"' for i in range(600)), 1, "tool_choice")
    assert caught.value.param == "tool_choice" and caught.value.code == "schema_too_large"
    assert structured.cache.keys() == []  # refused before any compile
    assert structured.constraints(object_schema(3, "small"), 1, "response_format")


def test_description_only_variants_share_one_cache_entry(tokenizer, monkeypatch) -> None:
    from llguidance import LLMatcher

    structured = StructuredOutputs(tokenizer)
    compiled = []
    real = LLMatcher.grammar_from_json_schema

    def counting(schema: dict[str, Any], **kwargs: Any) -> str:
        compiled.append(schema)
        return real(schema, **kwargs)

    monkeypatch.setattr(LLMatcher, "grammar_from_json_schema", counting)
    bare = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 5}},
        "required": ["title"],
        "additionalProperties": False,
    }
    annotated = {
        "title": "Book",
        "description": "a book",
        "$comment": "v2",
        "examples": [{"title": "x"}],
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 5, "description": "its title", "title": "Title"}},
        "required": ["title"],
        "additionalProperties": False,
    }
    structured.constraints(bare, 1, "response_format")
    structured.constraints(annotated, 1, "response_format")
    assert len(compiled) == 1 and len(structured.cache.keys()) == 1
    # A property named like an annotation is data: kept, and the answer must hold it.
    (constraint,) = structured.constraints(annotated, 1, "response_format")
    text = tokenizer.decode(
        [t for t in random_walk(constraint, len(tokenizer), 3, tokenizer.eos_token_id) if t != tokenizer.eos_token_id]
    )
    assert set(json.loads(text)) == {"title"}
    structured.constraints({**bare, "required": []}, 1, "response_format")  # a real difference: a second entry
    assert len(compiled) == 2


def test_the_cache_keeps_its_bytes_within_the_budget_least_recently_used_first_out(tokenizer) -> None:
    from transformers_openai.serving.text.grammar_cache import estimate_bytes

    schemas = [object_schema(20, f"s{i}") for i in range(8)]
    grammar_bytes = estimate_bytes(grammar_of(schemas[0]))
    budget = 3 * grammar_bytes + grammar_bytes // 2  # room for three entries of this size
    structured = StructuredOutputs(tokenizer, cache_bytes=budget)
    keys = []
    for i, schema in enumerate(schemas):
        structured.constraints(schema, 1, "response_format")
        keys.append(structured.cache.keys()[-1])
        assert structured.cache.nbytes <= budget
        if i == 3:  # the oldest kept is used again: it stays, the next oldest goes
            structured.constraints(schemas[1], 1, "response_format")
    kept = structured.cache.keys()
    assert len(kept) == 3 and kept == keys[-3:]
    assert StructuredOutputs(tokenizer, cache_bytes=0).constraints(schemas[0], 1, "response_format")  # keeps none


def grammar_of(schema: dict[str, Any]) -> str:
    """The grammar llguidance compiles for a schema."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def test_least_recently_used_order_within_the_budget() -> None:
    from transformers_openai.serving.text.grammar_cache import CompiledGrammar, GrammarCache

    cache = GrammarCache(100)

    def entry(nbytes: int) -> CompiledGrammar:
        return CompiledGrammar(None, torch.zeros(1, dtype=torch.bool), 0.0, nbytes)

    for key in "abcd":
        cache.put(key, entry(30))
    assert cache.keys() == ["b", "c", "d"] and cache.nbytes == 90
    assert cache.get("b") is not None  # used: now the most recent
    cache.put("e", entry(50))
    assert cache.keys() == ["b", "e"] and cache.nbytes == 80
    cache.put("huge", entry(101))  # larger than the whole budget: not kept, nothing dropped for it
    assert cache.keys() == ["b", "e"]


def test_the_estimate_is_above_what_compiling_takes(tokenizer) -> None:
    """Heap measured around compiling distinct schemas (glibc's mallinfo2) stays under the estimate of each."""
    import ctypes

    from transformers_openai.serving.text.grammar_cache import estimate_bytes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("no glibc mallinfo2 here")

    class MallInfo(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    mallinfo2.restype = MallInfo

    def heap() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    structured = StructuredOutputs(tokenizer)
    structured.constraints(object_schema(5, "warm"), 1, "response_format")
    kept = structured.cache.nbytes
    schemas = [object_schema(100, f"m{i}") for i in range(6)]
    before = heap()
    for schema in schemas:
        structured.constraints(schema, 1, "response_format")
    grown = heap() - before
    estimated = sum(estimate_bytes(grammar_of(schema)) for schema in schemas)
    assert 0 < grown <= estimated and structured.cache.nbytes == kept + estimated


def test_a_pattern_past_llguidances_limits_is_a_400_before_any_token(structured) -> None:
    """`^x{50000}$` (43 bytes) took 15-45 ms a mask under llguidance's default limits; ours refuse it up front."""
    with pytest.raises(BadRequestError) as caught:
        structured.constraints({"type": "string", "pattern": "^x{50000}$"}, 1, "response_format")
    assert caught.value.param == "response_format" and "lexer" in caught.value.message
    assert "<state>" not in caught.value.message  # llguidance's parser dump is not sent back


def test_a_grammar_costly_from_its_first_masks_is_a_400_before_any_token(structured) -> None:
    with pytest.raises(BadRequestError) as caught:  # 7-10 ms a mask from the start: the compile sees it
        structured.constraints({"type": "string", "pattern": "^x{20000}$"}, 1, "response_format")
    assert caught.value.code == "grammar_too_costly" and "first token masks" in caught.value.message


def test_a_grammar_whose_masks_cost_too_much_ends_its_row(structured, tokenizer) -> None:
    from transformers_openai.engine.errors import ConstraintFailed

    (constraint,) = structured.constraints(COSTLY, 1, "response_format")
    with pytest.raises(ConstraintFailed) as caught:
        random_walk(constraint, len(tokenizer), 0, tokenizer.eos_token_id)
    assert "too costly" in str(caught.value)
    with pytest.raises(ConstraintFailed):  # and stays failed, whoever asks (the engine retries a failed draw)
        constraint.mask(torch.zeros(len(tokenizer)))
    with pytest.raises(ConstraintFailed):
        constraint.advance(0)
    # A generous budget lets the same grammar go on: the budget, not llguidance, ended it.
    from transformers_openai.serving.text.grammar_constraint import MaskBudget

    lenient = StructuredOutputs(tokenizer, budget=MaskBudget(grace_s=60.0, per_token_s=1.0))
    (patient,) = lenient.constraints(COSTLY, 1, "response_format")
    for _ in range(10):
        logits = torch.zeros(len(tokenizer))
        patient.mask(logits)
        patient.advance(int(logits.argmax()))
    assert patient.spent_s > 0


def test_masks_are_computed_ahead_on_the_workers(structured, tokenizer) -> None:
    """`advance` hands the next mask to the mask threads; `mask` on the engine thread only applies it."""
    import threading

    from transformers_openai.serving.text import grammar_constraint

    threads = []
    real = grammar_constraint.disallowed_tokens

    def recording(bitmask: NDArray[np.int32], vocab: int) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return real(bitmask, vocab)

    (constraint,) = structured.constraints(SCHEMAS[0], 1, "response_format")
    grammar_constraint.disallowed_tokens = recording
    try:
        random_walk(constraint, len(tokenizer), 1, tokenizer.eos_token_id)
    finally:
        grammar_constraint.disallowed_tokens = real
    assert threads and all(name.startswith("grammar-mask") for name in threads)


@pytest.mark.parametrize("name", list(nasty_schemas()))
def test_nasty_schemas_get_a_400_or_a_grammar_that_can_fail_only_as_the_requests_fault(
    structured, tokenizer, name: str
) -> None:
    from transformers_openai.engine.errors import ConstraintFailed

    try:
        (constraint,) = structured.constraints(nasty_schemas()[name], 1, "response_format")
    except BadRequestError as exc:
        assert exc.status_code == 400 and exc.param == "response_format"
        return
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(60):
            logits = torch.randn(len(tokenizer), generator=generator)
            constraint.mask(logits)
            constraint.advance(int(logits.argmax()))
            if constraint.is_done():
                break
    except ConstraintFailed:
        pass


def test_annotation_only_variants_share_an_entry_wherever_the_annotations_are(tokenizer) -> None:
    """Annotations added at random places of each test schema (hypothesis): one entry per schema all the same."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    structured = StructuredOutputs(tokenizer)
    annotation = st.sampled_from(sorted(ANNOTATIONS)).flatmap(lambda key: st.tuples(st.just(key), st.text(max_size=8)))

    def annotate(schema: Any, draw: Any) -> Any:
        if isinstance(schema, list):
            return [annotate(item, draw) for item in schema]
        if not isinstance(schema, dict):
            return schema
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key in ("properties", "$defs"):
                out[key] = {name: annotate(sub, draw) for name, sub in value.items()}
            elif key in ("enum", "const", "required"):
                out[key] = value
            else:
                out[key] = annotate(value, draw)
        if draw(st.booleans()):
            extra_key, text = draw(annotation)
            out[extra_key] = [text] if extra_key == "examples" else text
        return out

    for schema in SCHEMAS:
        structured.constraints(schema, 1, "response_format")
    entries = structured.cache.keys()
    assert len(entries) == len(SCHEMAS)

    @given(data=st.data(), index=st.integers(0, len(SCHEMAS) - 1))
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def variants_hit_their_entry(data: st.DataObject, index: int) -> None:
        structured.constraints(annotate(SCHEMAS[index], data.draw), 1, "response_format")
        assert structured.cache.keys()[-1] == entries[index] and len(structured.cache.keys()) == len(SCHEMAS)

    variants_hit_their_entry()


def test_concurrent_requests_for_a_new_schema_compile_it_once(tokenizer, monkeypatch) -> None:
    import threading

    from llguidance import LLMatcher

    structured = StructuredOutputs(tokenizer)
    calls = []
    real = LLMatcher.grammar_from_json_schema
    started = threading.Barrier(4)

    def counting(schema: dict[str, Any], **kwargs: Any) -> str:
        calls.append(schema)
        return real(schema, **kwargs)

    monkeypatch.setattr(LLMatcher, "grammar_from_json_schema", counting)
    results: list[object] = []

    def ask(schema: dict[str, Any]) -> None:
        started.wait()
        try:
            results.append(len(structured.constraints(schema, 1, "response_format")))
        except BadRequestError as exc:
            results.append(exc.param)

    for schema in (COSTLY, {"type": "string", "pattern": "^x{50000}$"}):
        results.clear()
        calls.clear()
        threads = [threading.Thread(target=ask, args=(schema,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(set(map(str, results))) == 1 and len(results) == 4  # all the grammar, or all the same 400
        # One compile: a thread coming after it finished finds the grammar cached, or compiles a refused one again.
        assert len(calls) == 1 if schema is COSTLY else len(calls) <= 2
