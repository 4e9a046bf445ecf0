"""Quantized checkpoints made here, from the tiny Llama and SmolLM2, with each format's own library (no hub)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# What GPTQ calibrates on: three dozen sentences of plain English (no dataset, no hub; GPTQModel drops very short
# samples).
CALIBRATION = [
    f"{subject} {verb} {place} every {time}, and then tells everyone nearby a long story about the weather."
    for subject in ("The old baker", "A young student", "My neighbour", "The small dog")
    for verb in ("walks to", "writes about", "dreams of")
    for place, time in (("the river", "morning"), ("the market", "week"), ("the library", "evening"))
]


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


def build_compressed_tensors(source: Path, dest: Path, scheme: str, group_size: int = 32) -> Path:
    """`source` quantized by the compressed-tensors library as llm-compressor's data-free path does it (min/max
    weight scales, round to nearest, the output layer left alone) and saved compressed. `scheme`: a preset such
    as W8A8 (int8 weights per channel, int8 activations per token at run time) or W4A16 (int4 weights in groups of
    `group_size`: 128, the preset's, divides neither SmolLM2's 576 nor the tiny Llama's 64)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    preset = preset_name_to_scheme(scheme, targets=["Linear"])
    if preset.weights.strategy == QuantizationStrategy.GROUP:
        preset.weights.group_size = group_size
    config = QuantizationConfig(
        config_groups={"group_0": preset}, ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if not is_module_quantized(module):
                continue
            options = module.quantization_scheme.weights
            weight = module.weight.detach().float()
            if options.strategy == QuantizationStrategy.GROUP:  # the extremes of each group of input columns
                grouped = weight.reshape(weight.shape[0], -1, options.group_size)
                low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
            else:  # per output channel
                low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
            scale, zero_point = calculate_qparams(low, high, options)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape
                )
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    compressor.update_config(str(tmp))
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def build_gptq(source: Path, dest: Path, bits: int = 4, group_size: int = 32) -> Path:
    """`source` quantized by GPTQModel (GPTQ, `bits` per weight in groups of `group_size`, calibrated on
    `CALIBRATION`) and saved in bfloat16, the dtype its CPU kernel is fast in. Made in a child process: importing
    gptqmodel sets environment variables of its own."""
    if (dest / "config.json").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # Its CPU worker pool wants two workers even on a machine whose default gives it one.
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2"}
    here, source, tmp = Path(__file__).resolve(), source.resolve(), tmp.resolve()
    command = [sys.executable, str(here), "gptq", str(source), str(tmp), str(bits), str(group_size)]
    # From the folder it writes to: GPTQModel leaves logs in ./logs.
    subprocess.run(command, check=True, env=env, timeout=900, cwd=dest.parent)
    tmp.rename(dest)
    return dest


def _make_gptq(source: str, dest: str, bits: int, group_size: int) -> None:
    import torch
    from gptqmodel import GPTQConfig, GPTQModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    config = GPTQConfig(bits=bits, group_size=group_size, desc_act=False)
    model = GPTQModel.load(source, config, device="cpu", dtype=torch.bfloat16)
    model.quantize(CALIBRATION, batch_size=1, tokenizer=tokenizer)
    model.save(dest)
    tokenizer.save_pretrained(dest)


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


if __name__ == "__main__":
    if sys.argv[1] == "gptq":  # build_gptq's child process
        _make_gptq(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
