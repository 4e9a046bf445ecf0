"""`loadtest random-model`'s presets: the shapes the GPU runs measure, checked on their configs alone (no weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from loadtest import random_model
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def test_llama_8b_preset_has_llama_3_1_8b_layers_over_the_like_vocabulary(smollm2_dir: Path) -> None:
    config = random_model.preset_config(smollm2_dir, "llama-8b")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 14336, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    assert config.vocab_size == 49152 and not config.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    # Llama 3.1 8B's 8.03B less its larger vocabulary's two tables: (128,256 - 49,152) x 4,096 x 2 = 0.65B.
    assert abs(params - (8_030_261_248 - (128_256 - 49_152) * 4096 * 2)) < 1_000_000
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, device="cpu")
    assert inv_freq[-1] < 1 / 500000 ** (126 / 128)  # the long wavelengths scaled down 8x, as Llama 3.1's


def test_llama_1b_preset_keeps_the_like_model_s_rope(smollm2_dir: Path) -> None:
    config = random_model.preset_config(smollm2_dir, "llama-1b")
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (2048, 16, True)
    assert config.rope_parameters["rope_type"] == "default"
