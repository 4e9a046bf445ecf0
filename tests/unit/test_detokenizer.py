"""IncrementalDetokenizer: token-by-token deltas add up to the tokenizer's own decode, with no broken characters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from transformers_openai.engine.detokenizer import IncrementalDetokenizer

torch.set_num_threads(1)

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world! How are you today? Fine, thanks.",
    "🦙🚀",
    "東京は日本の首都です",
    "café naïve résumé",
    "\n\n  leading spaces\n\tand tabs\n",
    "  two leading spaces",
    "mixed: 🦙 says 東京 and café!",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Every delta, including the final flush."""
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_full_decode(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(tokenizer) -> None:
    ids = tokenizer("🦙", add_special_tokens=False).input_ids
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🦙"


def test_context_keeps_first_tokens_leading_space(tokenizer) -> None:
    prompt = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    completion = tokenizer(" Paris, of course.", add_special_tokens=False).input_ids
    deltas = stream(IncrementalDetokenizer(tokenizer, context=prompt), completion)
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " Paris, of course."


class SentencePieceLike:
    """Decodes like SentencePiece: "▁" is a space and the text's leading space is dropped."""

    pieces = ["▁The", "▁capital", "▁is", "▁Paris", ",", "▁of", "▁course"]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(self.pieces[i] for i in token_ids).replace("▁", " ")
        return text.removeprefix(" ")


def test_context_keeps_leading_space_a_lone_decode_would_strip() -> None:
    prompt, completion = [0, 1, 2], [3, 4, 5, 6]
    assert "".join(stream(IncrementalDetokenizer(SentencePieceLike()), completion)) == "Paris, of course"
    deltas = stream(IncrementalDetokenizer(SentencePieceLike(), context=prompt), completion)
    assert deltas[0] == " Paris"
    assert "".join(deltas) == " Paris, of course"


@pytest.mark.parametrize("text", ["東京は日本の首都です", "🦙🚀 and more 🦙"])
def test_context_ending_in_multibyte_text(tokenizer, text: str) -> None:
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    completion = tokenizer(text, add_special_tokens=False).input_ids
    deltas = stream(IncrementalDetokenizer(tokenizer, context=prompt), completion)
    full = tokenizer.decode(prompt + completion)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt)) :]
    assert not any(REPLACEMENT in d for d in deltas)


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = tokenizer("Hi there", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    deltas = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=True), ids)
    assert "".join(deltas) == "Hi there"
    kept = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)
    assert "".join(kept) == "Hi there" + tokenizer.eos_token


def test_flush_releases_an_incomplete_character(tokenizer) -> None:
    ids = tokenizer("ok 🦙", add_special_tokens=False).input_ids[:-1]  # cut the emoji short
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas[-1].endswith(REPLACEMENT)


def test_long_sequence_survives_compaction(tokenizer) -> None:
    text = " ".join(f"{TEXTS[i % len(TEXTS)]} #{i}" for i in range(60))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) >= 500
    deltas = stream(IncrementalDetokenizer(tokenizer, context=ids[:10]), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in d for d in deltas)
