"""The reasoning split: every cutting of a text into stream pieces gives the whole text's split, for `<think>`
markers as text and as added tokens, a thought the prompt opened or the model opens, and a response_template."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.reasoning_support import RESPONSE_TEMPLATE, THINK_TEMPLATE, THOUGHT_END, THOUGHT_START
from transformers_openai.serving.text.reasoning import MarkerSplitter, ReasoningFormat, TemplateReasoning, ThinkMarkers
from transformers_openai.serving.text.reasoning.splitter import ReasoningSplitter
from transformers_openai.serving.tokenizer import TokenizerService

# (text, thinking at start, expected reasoning, expected content)
CASES = [
    ("<think>abc</think>answer", False, "abc", "answer"),
    (" \n<think>abc</think>\n\nanswer", False, "abc", "\n\nanswer"),
    ("answer <think>x</think>", False, None, "answer <think>x</think>"),
    ("no thought", False, None, "no thought"),
    ("<think>unfinished", False, "unfinished", ""),
    ("<thi", False, None, "<thi"),
    ("<think", False, None, "<think"),
    ("  ", False, None, "  "),
    ("", False, None, ""),
    ("<think></think>", False, "", ""),
    ("abc</think>answer", True, "abc", "answer"),
    ("<think>abc</think>x", True, "abc", "x"),
    ("\n<think>\nabc</think>x", True, "\nabc", "x"),
    ("abc", True, "abc", ""),
    ("abc</thi", True, "abc</thi", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("\n</think>", True, "\n", ""),
    ("a <think> b</think>c", True, "a <think> b", "c"),
    ("", True, "", ""),
]


def _text_markers() -> ThinkMarkers:
    return ThinkMarkers(decode=lambda ids: "")


def _feed(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = splitter.feed(piece, 1)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


def _cuttings(text: str) -> list[list[str]]:
    """Every cutting of `text` into pieces of 1, 2 and 3 characters (from each offset), and at every one or two
    cut points."""
    cuts: list[list[str]] = []
    for size in (1, 2, 3):
        for offset in range(size):
            cuts.append([text[:offset]] + [text[i : i + size] for i in range(offset, len(text), size)])
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        cuts.append([text[:a], text[a:b], text[b:]])
    return cuts


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), CASES)
def test_the_whole_split(text: str, thinking: bool, reasoning: str | None, content: str) -> None:
    assert _text_markers().split(text, thinking) == (reasoning, content)


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), CASES)
def test_every_cutting_gives_the_whole_split(text: str, thinking: bool, reasoning: str | None, content: str) -> None:
    for pieces in _cuttings(text):
        splitter = MarkerSplitter("<think>", "</think>", thinking)
        assert _feed(splitter, pieces) == (reasoning or "", content), pieces
        assert splitter.had_thought == (reasoning is not None), pieces


def test_the_held_marker_is_never_sent_to_either_side() -> None:
    splitter = MarkerSplitter("<think>", "</think>", True)
    assert splitter.feed("abc</th", 1) == ("abc", "")
    assert splitter.thinking
    assert splitter.feed("ink>\n\nAn", 1) == ("", "\n\nAn")
    assert not splitter.thinking
    assert splitter.feed("swer", 1) == ("", "swer")
    assert splitter.reasoning_tokens == 2


def test_tokens_of_a_thought_the_model_opens_are_counted_once_it_is_one() -> None:
    splitter = MarkerSplitter("<think>", "</think>", False)
    for piece in ["\n", "<", "think", ">", "a", "</think>", "b", "c"]:
        splitter.feed(piece, 1)
    assert splitter.reasoning_tokens == 6  # up to the end marker, whitespace before the thought included
    plain = MarkerSplitter("<think>", "</think>", False)
    for piece in ["<", "b", "c"]:
        plain.feed(piece, 1)
    assert plain.reasoning_tokens == 0 and not plain.had_thought


@pytest.fixture(scope="module")
def think_tokenizer(tiny_llama_dir: Path) -> Any:
    """SmolLM2's tokenizer with the `<think>` template; `<think>` and `</think>` are plain text to it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = THINK_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def added_tokenizer(think_tokenizer: Any) -> Any:
    """The same with `<think>` and `</think>` as added (not special) tokens, as Qwen3 has them."""
    tokenizer = copy.deepcopy(think_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def _markers(tokenizer: Any, implicit_start: bool = False) -> ThinkMarkers:
    ids = tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    known = all(i != tokenizer.unk_token_id and i is not None for i in ids) and len(tokenizer) > tokenizer.vocab_size
    return ThinkMarkers(
        decode=lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False),
        implicit_start=implicit_start,
        marker_ids=(ids[0], ids[1]) if known else None,
    )


def _token_pieces(tokenizer: Any, text: str) -> tuple[list[int], list[str]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i], skip_special_tokens=False) for i in range(len(ids) + 1)]
    assert texts[-1] == text
    return ids, [texts[i + 1][len(texts[i]) :] for i in range(len(ids))]


@pytest.mark.parametrize("added", [False, True], ids=["text-markers", "added-token-markers"])
def test_token_by_token_of_a_real_tokenization(think_tokenizer: Any, added_tokenizer: Any, added: bool) -> None:
    tokenizer = added_tokenizer if added else think_tokenizer
    fmt = _markers(tokenizer)
    assert (fmt.marker_ids is not None) == added
    text = "Let me see: 2 + 2 is 4, not <th.</think>\n\nThe answer is 4 <think>"
    ids, pieces = _token_pieces(tokenizer, text)
    splitter = fmt.splitter(True)
    assert _feed(splitter, pieces) == ("Let me see: 2 + 2 is 4, not <th.", "\n\nThe answer is 4 <think>")
    end_ids = tokenizer.encode("</think>", add_special_tokens=False)
    thought_len = next(i for i in range(len(ids)) if "</think>" in tokenizer.decode(ids[: i + 1]))
    assert splitter.reasoning_tokens == thought_len + 1
    assert (len(end_ids) == 1) == added


@pytest.mark.parametrize("added", [False, True], ids=["text-markers", "added-token-markers"])
def test_the_prompt_says_whether_generation_starts_in_the_thought(
    think_tokenizer: Any, added_tokenizer: Any, added: bool
) -> None:
    tokenizer = added_tokenizer if added else think_tokenizer
    messages = [{"role": "user", "content": "Hi"}]

    def prompt(**variables: Any) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **variables)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    qwen3, deepseek = _markers(tokenizer), _markers(tokenizer, implicit_start=True)
    assert qwen3.thinks_at_start(prompt()) and deepseek.thinks_at_start(prompt())
    assert not qwen3.thinks_at_start(prompt(enable_thinking=False))
    assert not deepseek.thinks_at_start(prompt(enable_thinking=False))  # the template closed an empty thought
    plain = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert not qwen3.thinks_at_start(plain)  # qwen3: a thought only if the prompt or the model opens one
    assert deepseek.thinks_at_start(plain)  # deepseek_r1: the model thinks first, marker or not


def _template_format(tokenizer: Any) -> ReasoningFormat:
    service = TokenizerService(tokenizer, workers=1)
    fmt = TemplateReasoning.of(RESPONSE_TEMPLATE, service.decode_now)
    assert fmt is not None
    return fmt


TEMPLATE_TEXTS = [
    f"{THOUGHT_START}I should greet.{THOUGHT_END}\n\nHello!",
    "Hello <think>not a thought</think>",
    f"{THOUGHT_START}unfinished",
    f"{THOUGHT_START} a {THOUGHT_END}b",
]


@pytest.mark.parametrize("text", TEMPLATE_TEXTS)
def test_a_response_template_splits_as_parse_response_does(think_tokenizer: Any, text: str) -> None:
    tokenizer = copy.deepcopy(think_tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    fmt = _template_format(tokenizer)
    assert (fmt.start, fmt.end) == (THOUGHT_START, THOUGHT_END)
    reduced = fmt.template  # type: ignore[attr-defined]
    whole = tokenizer.parse_response(text, reduced, prefix="")
    reasoning, content = fmt.split(text, False)
    assert reasoning == (whole.get("reasoning_content") or None)
    assert content == whole.get("content", "")
    assert fmt.split(f"  {text}", False) == (reasoning, f"  {content}")  # parse_response keeps only the "  "
    for pieces in _cuttings(text):
        assert _feed(fmt.splitter(False), pieces) == (reasoning or "", content), pieces


def test_a_response_template_reads_the_prompt_for_an_opened_thought(think_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(think_tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    fmt = _template_format(tokenizer)
    opened = tokenizer.encode(f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{THOUGHT_START}\n")
    closed = tokenizer.encode(
        f"<|im_start|>assistant\n{THOUGHT_START}x{THOUGHT_END}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.thinks_at_start(opened) and not fmt.thinks_at_start(closed)
    assert fmt.split(f"thought{THOUGHT_END}answer", True) == ("thought", "answer")
    assert _feed(fmt.splitter(True), ["thou", f"ght{THOUGHT_END[:3]}", f"{THOUGHT_END[3:]}answer"]) == (
        "thought",
        "answer",
    )


def test_a_long_thought_being_continued_is_found_in_the_prompt(think_tokenizer: Any) -> None:
    """Markers as text are looked for in a window of the prompt's end that grows until it shows one."""
    fmt = _markers(think_tokenizer)
    opened = "<|im_start|>assistant\n<think>\n" + "and so on, " * 200
    assert fmt.thinks_at_start(think_tokenizer.encode(opened))
    assert not fmt.thinks_at_start(think_tokenizer.encode(opened + "</think>\n\n" + "the answer, " * 200))
    assert not fmt.thinks_at_start(think_tokenizer.encode("no marker at all, " * 200))
