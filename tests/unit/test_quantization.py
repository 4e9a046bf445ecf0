"""What is served and how: the checkpoint's own quantization named, --quantization planned, and the start-up errors
for formats this host cannot run, before any weight is read."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from transformers import PretrainedConfig

from transformers_openai.quantization import (
    LOAD_QUANTIZATIONS,
    QuantizationChoice,
    describe,
    plan_quantization,
    quantization_help,
)
from transformers_openai.settings import Settings

CPU = torch.device("cpu")


def config_with(quantization: dict[str, object] | None) -> PretrainedConfig:
    config = PretrainedConfig()
    if quantization is not None:
        config.quantization_config = quantization
    return config


def test_the_flag_choices_are_the_planned_ones_and_all_in_help() -> None:
    assert set(get_args(QuantizationChoice)) == {"none", *LOAD_QUANTIZATIONS}
    text = quantization_help()
    assert all(f"{name}:" in text for name in get_args(QuantizationChoice))
    assert Settings(quantization="int8-dynamic").quantization == "int8-dynamic"
    with pytest.raises(ValueError):
        Settings(quantization="int3")  # type: ignore[arg-type]  # not a choice, on purpose


@pytest.mark.parametrize(
    ("quantization", "name"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "gptq-4bit"),
        ({"quant_method": "awq", "bits": 4}, "awq-4bit"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes-4bit"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes-8bit"),
        (
            {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}},
            "torchao-int8-weight-only",
        ),
        ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "compressed-tensors-int-quantized"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
    ],
)
def test_a_checkpoints_quantization_is_named(quantization: dict[str, object], name: str) -> None:
    assert describe(quantization) == name


def test_an_unquantized_checkpoint_is_served_as_it_is_or_as_asked() -> None:
    assert plan_quantization(config_with(None), "none", CPU).served == "none"
    on_cpu = plan_quantization(config_with(None), "int8-dynamic", CPU)
    assert on_cpu.served == "int8-dynamic" and on_cpu.config is None and on_cpu.after_load is not None
    weight_only = plan_quantization(config_with(None), "int8-weight-only", CPU)
    assert weight_only.served == "torchao-int8-weight-only" and type(weight_only.config).__name__ == "TorchAoConfig"


def test_an_fp8_checkpoint_on_a_cpu_is_served_dequantized() -> None:
    # transformers dequantizes FP8 weights where there are no FP8 kernels; the name says so.
    plan = plan_quantization(config_with({"quant_method": "fp8", "weight_block_size": [128, 128]}), "none", CPU)
    assert plan.served == "fp8-dequantized" and plan.config is None


def test_a_quantized_checkpoint_is_not_quantized_again() -> None:
    config = config_with({"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"already quantized \(gptq-4bit\)"):
        plan_quantization(config, "int8-dynamic", CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only errors")
@pytest.mark.parametrize(
    ("config", "choice"),
    [
        (config_with(None), "fp8"),
        (config_with(None), "bitsandbytes-8bit"),
        (config_with(None), "bitsandbytes-4bit"),
    ],
)
def test_a_cuda_only_format_on_a_cpu_is_a_start_up_error_naming_cuda(config: PretrainedConfig, choice: str) -> None:
    with pytest.raises(RuntimeError, match="runs on CUDA GPUs only"):
        plan_quantization(config, choice, CPU)  # type: ignore[arg-type]


def test_a_missing_package_is_named_with_its_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gptqmodel" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install gptqmodel"):
        plan_quantization(config_with({"quant_method": "gptq", "bits": 4}), "none", CPU)
