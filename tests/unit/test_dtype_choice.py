"""`--dtype auto`: bf16 where the hardware multiplies it natively, float32 on other CPUs; an explicit dtype wins."""

from __future__ import annotations

import pytest
import torch

from transformers_openai.model_loader import cpu_has_native_bf16, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_auto_on_cpu_follows_the_native_bf16_units(monkeypatch, avx512_bf16: bool, amx: bool, expected) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert cpu_has_native_bf16() is (avx512_bf16 or amx)
    assert resolve_dtype("auto", CPU) == expected


def test_an_explicit_dtype_overrides_auto(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16


def test_a_torch_without_the_probes_means_float32(monkeypatch) -> None:
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert resolve_dtype("auto", CPU) == torch.float32
