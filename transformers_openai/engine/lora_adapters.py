"""The LoRA adapters resident beside a decoder's base model, by name: loaded at start or at run time (from allowed
directories only), at most `max_loras` at once, each of rank at most `max_rank`.

A request carries its adapter itself (`EngineRequest.lora`): unloading one takes its name away from new requests
while the requests already running with it finish with it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from transformers_openai.runners.lora.adapter import AdapterError, LoraAdapter, read_adapter

__all__ = ["AdapterError", "LoraAdapter", "LoraAdapters", "LoraLimits", "RuntimeLoadingOff", "UnknownAdapter"]


class UnknownAdapter(LookupError):
    """No adapter of that name is resident."""


class RuntimeLoadingOff(PermissionError):
    """Adapters are not loaded or unloaded at run time (no --allow-runtime-lora)."""


@dataclass(frozen=True)
class LoraLimits:
    """How many adapters may be resident, their largest rank, and where run-time loads may read from (`dirs`; None
    when adapters are not loaded at run time)."""

    max_loras: int
    max_rank: int
    dirs: tuple[Path, ...] | None = None


class LoraAdapters:
    """The resident adapters of one base model, whose layers an adapter may target are `shapes` ((in, out) by name)."""

    def __init__(
        self,
        base_model: str,
        shapes: dict[str, tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
        limits: LoraLimits,
    ) -> None:
        self.base_model = base_model
        self._shapes = shapes
        self._dtype = dtype
        self._device = device
        self._resident: dict[str, LoraAdapter] = {}
        self._loads = itertools.count(1)
        self._lock = threading.Lock()
        self.limits = limits

    def get(self, name: str) -> LoraAdapter | None:
        return self._resident.get(name)

    def resident(self) -> list[LoraAdapter]:
        return list(self._resident.values())

    def load(self, name: str, path: Path, at_run_time: bool = False) -> LoraAdapter:
        """Reads the adapter at `path` under `name` (blocking: call it in a worker thread). Raises `AdapterError` with
        the reason when it cannot be served, or when the name is taken or no room is left; `RuntimeLoadingOff`."""
        limits = self.limits
        if at_run_time:
            self._check_run_time_path(path)
        with self._lock:
            self._check_room(name)
        adapter = read_adapter(
            name, f"{name}#{next(self._loads)}", path, self._shapes, limits.max_rank, self._dtype, self._device
        )
        with self._lock:
            self._check_room(name)
            self._resident[name] = adapter
        return adapter

    def unload(self, name: str, at_run_time: bool = True) -> None:
        if at_run_time and self.limits.dirs is None:
            raise RuntimeLoadingOff("adapters are not unloaded at run time (start with --allow-runtime-lora)")
        with self._lock:
            if self._resident.pop(name, None) is None:
                raise UnknownAdapter(f"no LoRA adapter named '{name}' is loaded")

    def _check_room(self, name: str) -> None:
        if name == self.base_model:
            raise AdapterError(f"'{name}' is the base model's name")
        if name in self._resident:
            raise AdapterError(f"a LoRA adapter named '{name}' is already loaded")
        if len(self._resident) >= self.limits.max_loras:
            raise AdapterError(f"{self.limits.max_loras} adapters are loaded, as many as --max-loras allows")

    def _check_run_time_path(self, path: Path) -> None:
        dirs = self.limits.dirs
        if dirs is None:
            raise RuntimeLoadingOff("adapters are not loaded at run time (start with --allow-runtime-lora)")
        resolved = path.resolve()
        if not any(resolved.is_relative_to(allowed.resolve()) for allowed in dirs):
            raise AdapterError(f"'{path}' is not under a directory adapters may be loaded from (--lora-dir)")
