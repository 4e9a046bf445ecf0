"""Which reasoning format a served model gets: --reasoning-parser, and for `auto` what its tokenizer says."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.app.fake_engine import FakeEngine
from tests.reasoning_support import RESPONSE_TEMPLATE, THINK_TEMPLATE, THOUGHT_END, THOUGHT_START
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.text.reasoning import TemplateReasoning, ThinkMarkers, reasoning_format
from transformers_openai.serving.tokenizer import TokenizerService


@pytest.fixture(scope="module")
def base_tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's: its template writes no thought


def _context(tokenizer: Any, parser: str, template: str | None = THINK_TEMPLATE, **fields: Any) -> ServingContext:
    return ServingContext(
        engine=FakeEngine(),
        tokenizer=TokenizerService(copy.deepcopy(tokenizer), template, workers=1),
        model_name="m",
        model_aliases=frozenset({"m"}),
        max_model_len=256,
        model_kind="causal-lm",
        reasoning_parser=parser,
        **fields,
    )


def test_auto_reads_the_chat_template(base_tokenizer: Any) -> None:
    fmt = reasoning_format(_context(base_tokenizer, "auto"))
    assert isinstance(fmt, ThinkMarkers)
    assert (fmt.name, fmt.start, fmt.end, fmt.implicit_start) == ("qwen3", "<think>", "</think>", False)
    assert fmt.marker_ids is None and not fmt.keeps_markers  # plain text to this vocabulary
    assert reasoning_format(_context(base_tokenizer, "auto", template=None)) is None  # a template without <think>


def test_the_named_parsers(base_tokenizer: Any) -> None:
    assert reasoning_format(_context(base_tokenizer, "none")) is None
    deepseek = reasoning_format(_context(base_tokenizer, "deepseek_r1", template=None))
    assert isinstance(deepseek, ThinkMarkers) and deepseek.implicit_start and deepseek.name == "deepseek_r1"
    qwen3 = reasoning_format(_context(base_tokenizer, "qwen3", template=None))  # named: whatever the template says
    assert isinstance(qwen3, ThinkMarkers) and not qwen3.implicit_start
    assert reasoning_format(_context(base_tokenizer, "response_schema")) is None  # the tokenizer has none
    assert reasoning_format(_context(base_tokenizer, "qwen3", encoder_decoder=True)) is None


def test_a_response_template_comes_first(base_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    for parser in ("auto", "response_schema"):
        fmt = reasoning_format(_context(tokenizer, parser))
        assert isinstance(fmt, TemplateReasoning)
        assert (fmt.start, fmt.end, fmt.field) == (THOUGHT_START, THOUGHT_END, "reasoning_content")
    assert isinstance(reasoning_format(_context(tokenizer, "qwen3")), ThinkMarkers)
    # A thought field delimited by a pattern cannot be written back: <think> from the chat template instead.
    patterned = copy.deepcopy(RESPONSE_TEMPLATE)
    thought: Any = patterned["fields"]
    thought["reasoning_content"] = {"open_pattern": r"\[THINK\]", "close": THOUGHT_END}
    tokenizer.response_template = patterned
    assert isinstance(reasoning_format(_context(tokenizer, "auto")), ThinkMarkers)


@pytest.mark.parametrize("special", [False, True])
def test_markers_that_are_added_tokens_are_found_by_id(base_tokenizer: Any, special: bool) -> None:
    tokenizer = copy.deepcopy(base_tokenizer)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    else:
        tokenizer.add_tokens(["<think>", "</think>"])
    fmt = reasoning_format(_context(tokenizer, "auto"))
    assert isinstance(fmt, ThinkMarkers)
    assert fmt.marker_ids == tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    assert fmt.keeps_markers == special  # special tokens must be kept in the decoded text to be seen
