"""What the model itself generates for one request alone: the ground truth batching must match."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=2)
def load(model_dir: str):  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, tokenizer


def greedy_text(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    """model.generate alone, greedy; returns (text without the EOS, completion token count)."""
    model, tokenizer = load(str(model_dir))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    new = out[0, len(prompt_ids) :].tolist()
    count = len(new)
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    for i, token in enumerate(new):
        if token in eos_ids:
            new = new[:i]
            count = i + 1
            break
    return tokenizer.decode(new, skip_special_tokens=True), count


def chat_prompt_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    _, tokenizer = load(str(model_dir))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_prompt_ids(model_dir: Path, text: str) -> list[int]:
    _, tokenizer = load(str(model_dir))
    return list(tokenizer.encode(text))
