"""A model directory with random weights, for speed and memory runs where no real checkpoint can travel.

The shape is a real model's (`--like`: its config, tokenizer and chat template are copied), optionally resized to a
named preset; the weights are drawn at random. Speed and memory depend on the shape only, and with `ignore_eos`
every request runs its full length, so the figures equal those of the real weights.

Presets:
    same      the `--like` model's own shape (e.g. SmolLM2-135M)
    llama-1b  Llama 3.2 1B's layer shape (hidden 2048, 16 layers, 32 query / 8 K/V heads, MLP 8192) over the
              `--like` tokenizer's vocabulary

Example:
    loadtest random-model --like .cache/models/smollm2-135m-instruct --preset llama-1b --out /tmp/l1b
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

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
}
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def build(like: Path, preset: str, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(like)
    for key, value in PRESETS[preset].items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    # Drawn on the GPU where there is one: seconds for the 1B shape, where a CPU takes a minute and more.
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
