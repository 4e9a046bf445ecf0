"""What `--tensor-parallel-size` refuses at start, from the config alone."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import GPT2Config, LlamaConfig, PretrainedConfig, Qwen2Config, T5Config

from transformers_openai.parallel.checks import tensor_parallel_problem


def problem(config: PretrainedConfig, kind: str = "causal-lm", size: int = 2, **settings: Any) -> str | None:
    return tensor_parallel_problem(
        config, kind, size, settings.get("quantization", "none"), settings.get("gguf_file"), settings.get("device_map")
    )


def test_a_model_whose_heads_divide_is_taken() -> None:
    assert problem(LlamaConfig(num_attention_heads=8, num_key_value_heads=2)) is None
    assert problem(Qwen2Config(num_attention_heads=12, num_key_value_heads=4), size=4) is None
    assert problem(GPT2Config(), size=1) is None  # one rank: nothing to split


@pytest.mark.parametrize(
    ("config", "size", "message"),
    [
        (LlamaConfig(num_attention_heads=8, num_key_value_heads=1), 2, "attention heads (8) and K/V heads (1)"),
        (
            LlamaConfig(hidden_size=384, num_attention_heads=6, num_key_value_heads=6),
            4,
            "attention heads (6) and K/V heads (6)",
        ),
        (GPT2Config(), 2, "no tensor-parallel plan for gpt2 models"),
    ],
)
def test_a_model_it_cannot_split_is_named(config: PretrainedConfig, size: int, message: str) -> None:
    found = problem(config, size=size)
    assert found is not None and message in found and f"--tensor-parallel-size {size}" in found


def test_other_kinds_and_settings_are_refused() -> None:
    llama = LlamaConfig(num_attention_heads=8, num_key_value_heads=2)
    assert "decoder-only" in (problem(T5Config(), kind="seq2seq") or "")
    assert "decoder-only" in (problem(llama, kind="embedding") or "")
    assert "--device-map" in (problem(llama, device_map="auto") or "")
    assert "unquantized" in (problem(llama, quantization="int8-dynamic") or "")
    assert "unquantized" in (problem(llama, gguf_file="model.gguf") or "")
