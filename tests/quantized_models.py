"""Quantized checkpoints made here, from the tiny Llama and SmolLM2, with each format's own library (no hub)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def build_torchao(source: Path, dest: Path, config_name: str) -> Path:
    """`source` quantized by torchao (`config_name`: a torchao.quantization config class) and saved."""
    if (dest / "config.json").exists():
        return dest
    import torch
    import torchao.quantization
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    config = TorchAoConfig(getattr(torchao.quantization, config_name)())
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, quantization_config=config)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=False)  # torchao's tensor subclasses: a pickled state dict
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def with_quantization_config(source: Path, dest: Path, quantization: dict[str, object]) -> Path:
    """A copy of `source` whose config claims a quantization (for the start-up errors of formats that cannot run
    here: the error comes before any weight is read)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(config))
    return dest
