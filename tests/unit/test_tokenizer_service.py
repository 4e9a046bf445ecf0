"""Prompts are rendered in a pool of threads with their own tokenizers: a long rendering blocks no other prompt,
and token texts for logprobs never wait at all."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from transformers_openai.serving.tokenizer import TokenizerService, engine_decoder


class _Gate:
    """Holds the first rendering that asks until released (class-level: tokenizers are deep-copied per thread)."""

    entered = threading.Event()
    release = threading.Event()


def _slow_first_render(original: Any) -> Any:
    def render(self: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        if messages and messages[0]["content"] == "slow" and not _Gate.entered.is_set():
            _Gate.entered.set()
            _Gate.release.wait(10)
        return original(self, messages, *args, **kwargs)

    return render


async def test_a_long_rendering_does_not_block_other_prompts(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", _slow_first_render(type(tokenizer).apply_chat_template))
    service = TokenizerService(tokenizer, workers=2)
    try:
        slow = asyncio.ensure_future(service.encode_chat([{"role": "user", "content": "slow"}]))
        assert await asyncio.to_thread(_Gate.entered.wait, 5)
        start = time.monotonic()
        ids = await service.encode_chat([{"role": "user", "content": "quick"}])
        assert ids and time.monotonic() - start < 2.0  # did not wait for the 10 s the other rendering takes
        assert await service.encode_text("hello") == tokenizer.encode("hello")
        assert not slow.done()
        _Gate.release.set()
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "slow"}], add_generation_prompt=True, tokenize=False
        )
        assert await slow == tokenizer.encode(text, add_special_tokens=False)
    finally:
        _Gate.release.set()
        service.close()


def test_token_text_comes_from_the_event_loop_copy(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    service = TokenizerService(tokenizer)
    assert service.token_text(42) == tokenizer.decode([42], skip_special_tokens=False)


def test_longest_token_bounds_the_characters_per_token(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    longest = TokenizerService(tokenizer).longest_token_chars()
    text = "The quick brown fox " * 50 + " " * 200
    assert len(text) <= longest * len(tokenizer.encode(text, add_special_tokens=False))
    assert longest >= max(
        len(tokenizer.decode([i])) for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids
    )


def test_the_engine_decoder_decodes_as_transformers_does(tiny_llama_dir: Path, whisper_dir: Path) -> None:
    """The Rust decoder stands in for transformers' decode only where the text is the same: byte-level pieces,
    special tokens kept or skipped; Whisper's tokenizer, whose class decodes its own way, keeps its decode."""
    import random

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    decoder = engine_decoder(tokenizer)
    assert not isinstance(decoder, type(tokenizer))
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    text_ids = tokenizer("Héllo  wörld, 你好! <|im_end|> 12 + 3.5\n\tdone")["input_ids"]
    samples = [text_ids, *([rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))] for _ in range(300))]
    samples += [[*ids[:3], rng.choice(special), *ids[3:]] for ids in samples[:100]]
    for ids in samples:
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    whisper = AutoTokenizer.from_pretrained(whisper_dir)
    assert isinstance(engine_decoder(whisper), type(whisper))
