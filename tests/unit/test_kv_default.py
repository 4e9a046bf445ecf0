"""The default K/V budget on a CPU: a share of the free memory, capped, in whole steps, so that a restart while a
little more or less memory is free sizes the same pool (and reuses the decode step compiled for it)."""

from __future__ import annotations

import pytest
import torch

from transformers_openai import model_loader
from transformers_openai.model_loader import CPU_KV_CAP, resolve_kv_space

CPU = torch.device("cpu")
GIB = 2**30


def budget(monkeypatch: pytest.MonkeyPatch, free: int, setting: float | None = None) -> int:
    monkeypatch.setattr(model_loader, "_free_memory", lambda device: free)
    return resolve_kv_space(setting, 16, CPU).bytes


def test_free_memory_that_moves_a_little_gives_the_same_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = {budget(monkeypatch, free) for free in (int(9.1 * GIB), int(9.4 * GIB), int(9.9 * GIB))}
    assert sizes == {2 * GIB}  # a quarter of 9.1 to 9.9 GiB, in whole 512 MiB steps
    assert budget(monkeypatch, 12 * GIB) == 3 * GIB


def test_the_cap_a_tiny_machine_and_an_explicit_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert budget(monkeypatch, 64 * GIB) == CPU_KV_CAP
    assert budget(monkeypatch, GIB) == GIB // 4  # less than a step: the share itself
    assert budget(monkeypatch, int(9.4 * GIB), setting=0.25) == int(9.4 * GIB * 0.25)  # asked for: as asked
    assert budget(monkeypatch, 9 * GIB, setting=3 * GIB + 1) == 3 * GIB + 1
