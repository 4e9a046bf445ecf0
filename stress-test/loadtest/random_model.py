"""A model directory with random weights, for speed and memory runs where no real checkpoint can travel.

The shape is a real model's (`--like`: its config, tokenizer and chat template are copied), optionally resized to a
named preset; the weights are drawn at random. Speed and memory depend on the shape only, and with `ignore_eos`
every request runs its full length, so the figures equal those of the real weights.

Presets:
    same      the `--like` model's own shape (e.g. SmolLM2-135M)
    llama-1b  Llama 3.2 1B's layer shape (hidden 2048, 16 layers, 32 query / 8 K/V heads, MLP 8192) over the
              `--like` tokenizer's vocabulary
    llama-8b  Llama 3.1 8B's shape (hidden 4096, 32 layers, 32 query / 8 K/V heads of 128, MLP 14336, untied output
              layer, Llama 3's rope: theta 500,000, scaled 8x from 8,192 positions) over the `--like` tokenizer's
              vocabulary (49,152 for SmolLM2's instead of Llama 3's 128,256: 7.4B parameters, 14.8 GB in bf16,
              where the real model has 8.0B; the output layer reads 0.4 GB a step instead of 1.05 GB)

Example:
    loadtest random-model --like .cache/models/smollm2-135m-instruct --preset llama-1b --out /tmp/l1b
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PRESETS: dict[str, dict[str, object]] = {
    "same": {},
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def preset_config(like: Path, preset: str) -> PretrainedConfig:
    """The `--like` model's config resized to `preset` (no weights)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(like)
    for key, value in PRESETS[preset].items():
        setattr(config, key, value)
    return config


def build(like: Path, preset: str, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    config = preset_config(like, preset)
    torch.manual_seed(seed)
    # Drawn on the GPU where there is one, in bf16 from the start: seconds for the 1B shape and the 8B one (15 GB),
    # where a CPU takes a minute and more for the 1B.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in COPIED:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{out}: {preset} shape of {like.name}, {params / 1e6:.0f}M parameters, random bf16 weights")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", type=Path, required=True, help="model directory whose config and tokenizer are used")
    p.add_argument("--preset", choices=sorted(PRESETS), default="same")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    build(args.like, args.preset, args.out, args.seed)


if __name__ == "__main__":
    main()
