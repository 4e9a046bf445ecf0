"""A LoRA adapter read from PEFT's format (a directory with `adapter_config.json` and `adapter_model.safetensors`)
and checked against the base model's layers: what cannot be served is refused with its reason, at load."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from transformers_openai.runners.lora.layers import LoraPair

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's names: the wrapped model's own layer names behind it


class AdapterError(ValueError):
    """An adapter that cannot be served on this model, with the reason."""


@dataclass(frozen=True)
class LoraAdapter:
    """A resident adapter: each targeted layer's low-rank pair by its name in the base model.

    `key` is unique to this load (the name and a counter): K/V blocks computed with it are never reused by a request
    with another adapter, or with an adapter loaded again under the same name.
    """

    name: str
    key: str
    path: Path
    rank: int
    base_model: str | None
    pairs: dict[str, LoraPair] = field(repr=False)


def read_adapter(
    name: str,
    key: str,
    path: Path,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    """The adapter at `path`, its pairs in `dtype` on `device`; `shapes` are the layers it may target ((in, out)
    features by name). Raises `AdapterError` with the reason for anything it cannot serve."""
    config = _config(path)
    rank = int(config.get("r", 0))
    if rank < 1:
        raise AdapterError(f"the adapter '{name}' has no rank ('r' in {CONFIG_FILE})")
    if rank > max_rank:
        raise AdapterError(f"the adapter '{name}' has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _weights(path)
    pairs: dict[str, LoraPair] = {}
    for layer in sorted({key.rsplit(".lora_", 1)[0] for key in tensors}):
        pairs[layer.removeprefix(_PREFIX)] = _pair(name, layer, tensors, shapes, rank, scaling, dtype, device)
    if not pairs:
        raise AdapterError(f"the adapter '{name}' holds no LoRA weights")
    base = config.get("base_model_name_or_path")
    return LoraAdapter(name, key, path, rank, base if isinstance(base, str) else None, pairs)


def _config(path: Path) -> dict[str, Any]:
    """The adapter's PEFT configuration, refused where it asks for what grouped LoRA products do not do."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"no readable {CONFIG_FILE} in {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} in {path} is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"only LoRA adapters are served, not {config.get('peft_type')}")
    unsupported = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
        "modules_to_save": "modules_to_save (whole layers trained beside the adapter)",
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
    }
    for option, what in unsupported.items():
        if config.get(option):
            raise AdapterError(f"adapters with {what} are not served")
    if config.get("bias", "none") != "none":
        raise AdapterError("adapters that train biases are not served (bias must be 'none')")
    return config


def _weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(str(path / WEIGHTS_FILE), device="cpu")
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"no readable {WEIGHTS_FILE} in {path}: {exc}") from exc
    other = [key for key in tensors if ".lora_A." not in key and ".lora_B." not in key]
    if other:
        raise AdapterError(f"the adapter holds weights other than LoRA pairs of linear layers (e.g. '{other[0]}')")
    return tensors


def _pair(
    name: str,
    layer: str,
    tensors: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    rank: int,
    scaling: float,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraPair:
    """One layer's pair, checked against the base layer it targets."""
    target = layer.removeprefix(_PREFIX)
    if target not in shapes:
        raise AdapterError(f"the adapter '{name}' targets '{target}', which is not a linear layer of this model")
    a, b = tensors.get(f"{layer}.lora_A.weight"), tensors.get(f"{layer}.lora_B.weight")
    if a is None or b is None:
        raise AdapterError(f"the adapter '{name}' lacks half of the pair of '{target}'")
    in_features, out_features = shapes[target]
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise AdapterError(
            f"the adapter '{name}' does not fit this model: '{target}' is {in_features} -> {out_features}, "
            f"its pair is {tuple(a.shape)} and {tuple(b.shape)} at rank {rank}"
        )
    return LoraPair(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), scaling)
