"""Random LoRA adapters in PEFT's format for a decoder, T5 or Whisper model, to measure serving them (`loadtest run
--models`) and to test them.

    loadtest lora-adapters --model .cache/models/smollm2-135m-instruct --out results/loras --count 4 --rank 16

writes `<out>/lora-0` ... `<out>/lora-3`, each targeting every attention and MLP projection with random weights
(seeded by its index), and prints the `--lora-modules` value that serves them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The query and value projections, as PEFT names them: Whisper's (encoder, decoder and cross-attention) and T5's.
WHISPER_TARGETS = ["q_proj", "v_proj"]
T5_TARGETS = ["q", "v"]


def make_adapter(
    model_dir: Path, dest: Path, seed: int, rank: int, scale: float = 0.02, targets: Sequence[str] = TARGETS
) -> None:
    """A rank-`rank` adapter on the layers `targets` name (default: every projection of a decoder) of the model at
    `model_dir` (a decoder, T5 or Whisper), saved in PEFT's format at `dest`: all LoRA weights drawn from N(0,
    `scale`^2) with `seed` (PEFT starts lora_B at zero, which would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = _base_model(model_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0)
    peft = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft.save_pretrained(str(dest))


def _base_model(model_dir: Path) -> Any:
    """The model at `model_dir` in float32, by its kind: Whisper, another encoder-decoder (T5), or a decoder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, WhisperForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type == "whisper":
        return WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the base model's directory")
    parser.add_argument("--out", type=Path, required=True, help="where the adapters' directories go")
    parser.add_argument("--count", type=int, default=4, help="adapters to make (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=16, help="their rank (default: %(default)s)")
    args = parser.parse_args(argv)
    modules = []
    for index in range(args.count):
        dest = args.out / f"lora-{index}"
        if not (dest / "adapter_config.json").exists():
            make_adapter(args.model, dest, seed=index + 1, rank=args.rank)
        modules.append(f"lora-{index}={dest}")
    print(",".join(modules))
    return 0
