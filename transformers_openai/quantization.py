"""Quantized weights: what a checkpoint's own quantization is, and the `--quantization` applied at load.

Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, bitsandbytes, torchao, FP8, ...) are read by transformers'
own quantizers from the `quantization_config` in `config.json`; this module only checks before the weights are read
that the package and the device the format needs are there, so that a missing kernel is a clear start-up error, and
names what is served for `/v1/models` and `/metrics`. An unquantized checkpoint can be quantized as it loads with
`--quantization`: int8 on any device (on a CPU through our own int8 layers, `int8_linear.py`; elsewhere torchao's),
bitsandbytes and FP8 on CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# How `--quantization int8-dynamic` multiplies on a CPU (`--int8-products`): `auto` decides at start from the CPU's
# flags and a short measurement (`int8_linear.choose_products`).
Int8Products = Literal["auto", "int8", "float"]

# The `--quantization` choices (LOAD_QUANTIZATIONS below, and none).
QuantizationChoice = Literal[
    "none", "int8-weight-only", "int8-dynamic", "fp8", "bitsandbytes-8bit", "bitsandbytes-4bit"
]


@dataclass(frozen=True)
class Requirement:
    """What a quantization format needs to load and run."""

    packages: tuple[tuple[str, str], ...] = ()  # (import name, what to pip install) of each package it needs
    cuda_capability: tuple[int, int] | None = None  # None: runs on a CPU too


TORCHAO = Requirement((("torchao", "torchao"),))
GPTQMODEL = Requirement((("gptqmodel", "gptqmodel"), ("optimum", "optimum")))  # transformers' GPTQ path wants both

# Pre-quantized formats by transformers' `quant_method`. Formats not listed here are left to transformers, whose
# error (if any) becomes the start-up error. An FP8 checkpoint needs nothing: transformers dequantizes it on a
# device without FP8 kernels (said as `fp8-dequantized`).
CHECKPOINT_FORMATS: dict[str, Requirement] = {
    "gptq": GPTQMODEL,
    "awq": Requirement((("gptqmodel", "gptqmodel"),)),
    "compressed-tensors": Requirement((("compressed_tensors", "compressed-tensors"),)),
    "torchao": TORCHAO,
    "bitsandbytes": Requirement((("bitsandbytes", "bitsandbytes"),)),
}


@dataclass(frozen=True)
class LoadQuantization:
    """A `--quantization` choice: applied to an unquantized checkpoint as its weights load."""

    served: str  # its name in /v1/models and /metrics: what `describe` calls a checkpoint saved with it
    summary: str  # for --help: what it does on a CPU and on CUDA
    requirement: Requirement
    build: Callable[[], Any]  # the transformers quantization config


# torchao's configuration classes by the --quantization choice that applies them.
TORCHAO_CONFIGS = {
    "Int8WeightOnlyConfig": "int8-weight-only",
    "Int8DynamicActivationInt8WeightConfig": "int8-dynamic",
    "Float8DynamicActivationFloat8WeightConfig": "fp8",
}


def _torchao(config_name: str) -> Callable[[], Any]:
    def build() -> Any:
        import torchao.quantization
        from transformers import TorchAoConfig

        return TorchAoConfig(getattr(torchao.quantization, config_name)())

    return build


def _bitsandbytes(**options: Any) -> Callable[[], Any]:
    def build() -> Any:
        import torch
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**options, bnb_4bit_compute_dtype=torch.bfloat16)  # type: ignore[no-untyped-call]

    return build


LOAD_QUANTIZATIONS: dict[str, LoadQuantization] = {
    "int8-weight-only": LoadQuantization(
        "torchao-int8-weight-only",
        "torchao int8 weights (per output channel), activations in the model's dtype: a quarter of float32's "
        "weight memory; CPU and CUDA",
        TORCHAO,
        _torchao("Int8WeightOnlyConfig"),
    ),
    "int8-dynamic": LoadQuantization(
        "torchao-int8-dynamic",
        "int8 weights per output channel and int8 activations quantized per token at run time (W8A8), the "
        "output layer left in full precision: on a CPU our own layers over oneDNN's integer product (VNNI/AMX), "
        "on CUDA torchao's",
        TORCHAO,
        _torchao("Int8DynamicActivationInt8WeightConfig"),
    ),
    "fp8": LoadQuantization(
        "torchao-fp8",
        "torchao float8 weights and dynamic float8 activations: CUDA GPUs of compute capability 8.9 or newer only",
        Requirement(TORCHAO.packages, cuda_capability=(8, 9)),
        _torchao("Float8DynamicActivationFloat8WeightConfig"),
    ),
    "bitsandbytes-8bit": LoadQuantization(
        "bitsandbytes-8bit",
        "bitsandbytes LLM.int8() weights: CUDA only",
        Requirement((("bitsandbytes", "bitsandbytes"),), (7, 0)),
        _bitsandbytes(load_in_8bit=True),
    ),
    "bitsandbytes-4bit": LoadQuantization(
        "bitsandbytes-4bit",
        "bitsandbytes NF4 weights, bfloat16 compute: CUDA only",
        Requirement((("bitsandbytes", "bitsandbytes"),), (7, 0)),
        _bitsandbytes(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    ),
}


def quantization_help() -> str:
    """The `--quantization` choices with what each does, for `--help`."""
    choices = "; ".join(f"{name}: {choice.summary}" for name, choice in LOAD_QUANTIZATIONS.items())
    return (
        "Quantize an unquantized checkpoint's linear layers as it loads (a pre-quantized checkpoint's own format is "
        f"read from its config.json and needs no flag). none: the checkpoint's weights as they are; {choices}."
    )


def checkpoint_quantization(config: Any) -> Mapping[str, Any] | None:
    """The `quantization_config` a checkpoint's config carries, as a mapping (None: not quantized)."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    if isinstance(found, Mapping):
        return found
    return dict(found.to_dict())


def describe(quantization: Mapping[str, Any]) -> str:
    """A short name for what a checkpoint's quantization is: `gptq-4bit`, `torchao-int8-weight-only`, ..."""
    method = str(quantization.get("quant_method", "unknown"))
    if method in ("gptq", "awq") and "bits" in quantization:
        return f"{method}-{quantization['bits']}bit"
    if method == "bitsandbytes":
        return "bitsandbytes-4bit" if quantization.get("load_in_4bit") else "bitsandbytes-8bit"
    if method == "torchao":
        # As saved: {"default": {"_type": "Int8WeightOnlyConfig", ...}}; a config object's own to_dict may differ.
        quant_type = quantization.get("quant_type")
        inner = quant_type.get("default", quant_type) if isinstance(quant_type, Mapping) else None
        name = inner.get("_type") if isinstance(inner, Mapping) else None
        return f"torchao-{TORCHAO_CONFIGS.get(name, name)}" if name else "torchao"
    if method == "compressed-tensors":
        return f"compressed-tensors-{quantization['format']}" if quantization.get("format") else method
    return method


def check_requirement(what: str, requirement: Requirement, device: torch.device) -> None:
    """Raises a start-up error naming the package or the device that `what` needs and this host lacks."""
    if requirement.cuda_capability is not None:
        major, minor = requirement.cuda_capability
        if device.type != "cuda":
            raise RuntimeError(
                f"{what} runs on CUDA GPUs only (compute capability {major}.{minor} or newer); this server runs on "
                f"{device.type}: serve an unquantized or int8 (--quantization int8-dynamic) model on a CPU"
            )
        import torch

        have = torch.cuda.get_device_capability(device)
        if have < requirement.cuda_capability:
            raise RuntimeError(
                f"{what} needs a CUDA GPU of compute capability {major}.{minor} or newer; "
                f"{torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}"
            )
    missing = [pip for name, pip in requirement.packages if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"{what} needs the package(s) {', '.join(missing)}: pip install {' '.join(missing)}")


@dataclass(frozen=True)
class QuantizationPlan:
    """How the weights of this start are quantized."""

    served: str  # what /v1/models and /metrics say: "none", or a format's name
    config: Any | None = None  # the transformers quantization config to load with (None: the checkpoint's own)
    after_load: Callable[[Any], int] | None = None  # swaps layers of the loaded model; returns how many


def plan_quantization(
    config: Any,
    choice: QuantizationChoice,
    device: torch.device,
    products: Int8Products = "auto",
    output_layer: bool = False,
) -> QuantizationPlan:
    """What this start serves and how, from the checkpoint's config and `--quantization`. Raises before any weight
    is read where the format cannot run here. On a CPU, int8 activations are multiplied in int8 only where that is
    fast here (`products`, `int8_linear.choose_products`); int8-dynamic rounds the output layer too with
    `output_layer` (`--int8-output-layer`)."""
    existing = checkpoint_quantization(config)
    if existing is not None:
        name = describe(existing)
        if choice != "none":
            raise ValueError(
                f"the checkpoint is already quantized ({name}): --quantization {choice} applies to unquantized "
                "checkpoints only"
            )
        requirement = CHECKPOINT_FORMATS.get(str(existing.get("quant_method")))
        if requirement is not None:
            check_requirement(f"this {name} checkpoint", requirement, device)
        if existing.get("quant_method") == "fp8" and device.type != "cuda":
            name = "fp8-dequantized"
        if name == "compressed-tensors-int-quantized" and device.type == "cpu" and _int8_products(products):
            from transformers_openai.int8_linear import use_int8_for_compressed_tensors  # W8A8: true int8 products

            return QuantizationPlan(name, after_load=use_int8_for_compressed_tensors)
        return QuantizationPlan(name)
    if choice == "none":
        return QuantizationPlan("none")
    if choice == "int8-dynamic" and device.type == "cpu":
        # torchao's int8 tensors are slow in eager mode on a CPU: the same scheme through our own layers.
        from transformers_openai.int8_linear import quantize_linear_layers, round_linear_weights

        after_load = quantize_linear_layers if _int8_products(products) else round_linear_weights
        return QuantizationPlan("int8-dynamic", after_load=partial(after_load, output_layer=output_layer))
    load = LOAD_QUANTIZATIONS[choice]  # every other choice is one (a unit test holds the two lists together)
    check_requirement(f"--quantization {choice}", load.requirement, device)
    return QuantizationPlan(load.served, load.build())


def _int8_products(products: Int8Products) -> bool:
    """Whether int8 activations are multiplied in int8 on this CPU (else in float over int8-rounded weights), said
    in the log with the reason."""
    from transformers_openai.int8_linear import choose_products, this_cpu_flags

    choice = choose_products(products, this_cpu_flags())
    if choice.int8:
        logger.info("int8 layers multiply in int8 (%s)", choice.reason)
    else:
        logger.warning("int8 weights multiplied in float32, activations not rounded (%s)", choice.reason)
    return choice.int8
