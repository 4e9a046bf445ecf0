"""How token states become one vector: the pooling of a sentence-transformers directory, or a kind's default."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

PoolingMode = Literal["mean", "cls", "last", "max"]

# sentence-transformers' Pooling config keys, by the mode each turns on.
_MODE_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
}
_UNSUPPORTED_KEYS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# The modules of a sentence-transformers pipeline we apply; any other (Dense, LayerNorm, ...) stops the start.
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


class UnsupportedPipeline(ValueError):
    """A sentence-transformers directory with a module or pooling mode this server cannot apply."""


@dataclass(frozen=True)
class PoolingSpec:
    """Which token states make the vector, and whether it is scaled to unit length.

    `max_length` is the longest input the model takes (sentence-transformers' `max_seq_length`), None where the
    directory does not say. `matryoshka_dims`: the shorter sizes the model was trained to be cut to (None: cutting
    is not allowed).
    """

    mode: PoolingMode
    normalize: bool
    max_length: int | None = None
    matryoshka_dims: tuple[int, ...] | None = None


def read_sentence_transformers(directory: Path) -> PoolingSpec | None:
    """The pipeline of a sentence-transformers directory (`modules.json`), or None when it is not one."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    mode: PoolingMode | None = None
    normalize = False
    for module in modules:
        kind = module.get("type", "")
        if kind == _TRANSFORMER:
            continue
        if kind == _POOLING:
            mode = _pooling_mode(json.loads((directory / module.get("path", "") / "config.json").read_text()))
        elif kind == _NORMALIZE:
            normalize = True
        else:
            raise UnsupportedPipeline(
                f"{directory}/modules.json has a module this server cannot apply: {kind or module!r} "
                f"(supported: Transformer, Pooling, Normalize)"
            )
    if mode is None:
        raise UnsupportedPipeline(f"{directory}/modules.json has no Pooling module")
    return PoolingSpec(mode=mode, normalize=normalize, max_length=_max_seq_length(directory))


def _pooling_mode(config: dict[str, object]) -> PoolingMode:
    for key in _UNSUPPORTED_KEYS:
        if config.get(key):
            raise UnsupportedPipeline(f"the Pooling module asks for {key}, which this server does not apply")
    modes = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
    if len(modes) != 1:
        raise UnsupportedPipeline(
            f"the Pooling module must turn on exactly one of {', '.join(_MODE_KEYS)} (it turns on {modes or 'none'})"
        )
    return modes[0]


def _max_seq_length(directory: Path) -> int | None:
    path = directory / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return int(value) if isinstance(value, int) else None


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """One vector per row of right-padded `hidden` [rows, tokens, width], `mask` [rows, tokens] (1: a real token)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
