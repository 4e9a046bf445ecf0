"""Pooling modes against plain loops, and the sentence-transformers pipeline read from a directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from transformers_openai.runners.pooling import UnsupportedPipeline, pool, read_sentence_transformers

HIDDEN = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3) ** 1.5
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


def test_mean_averages_only_real_tokens() -> None:
    got = pool(HIDDEN, MASK, "mean")
    assert torch.allclose(got[0], HIDDEN[0].mean(0))
    assert torch.allclose(got[1], HIDDEN[1, :2].mean(0))


def test_cls_last_and_max() -> None:
    assert torch.equal(pool(HIDDEN, MASK, "cls"), HIDDEN[:, 0])
    assert torch.equal(pool(HIDDEN, MASK, "last"), torch.stack([HIDDEN[0, 3], HIDDEN[1, 1]]))
    assert torch.equal(pool(-HIDDEN, MASK, "max")[1], (-HIDDEN[1, :2]).amax(0))  # padding never wins


def _pipeline(tmp_path: Path, modules: list[str], pooling: dict[str, bool], max_seq_length: int = 128) -> Path:
    entries: list[dict[str, Any]] = [  # modules.json
        {"idx": i, "name": str(i), "path": f"{i}_{m}", "type": f"sentence_transformers.models.{m}"}
        for i, m in enumerate(modules)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    for entry in entries:
        if entry["type"].endswith("Pooling"):
            (tmp_path / entry["path"]).mkdir()
            (tmp_path / entry["path"] / "config.json").write_text(
                json.dumps({"word_embedding_dimension": 8, **pooling})
            )
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return tmp_path


def test_reads_mode_normalize_and_length(tmp_path: Path) -> None:
    spec = read_sentence_transformers(
        _pipeline(tmp_path, ["Transformer", "Pooling", "Normalize"], {"pooling_mode_mean_tokens": True}, 256)
    )
    assert spec is not None and (spec.mode, spec.normalize, spec.max_length) == ("mean", True, 256)


def test_last_token_without_normalize(tmp_path: Path) -> None:
    spec = read_sentence_transformers(_pipeline(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_lasttoken": True}))
    assert spec is not None and (spec.mode, spec.normalize) == ("last", False)


def test_not_a_sentence_transformers_directory(tmp_path: Path) -> None:
    assert read_sentence_transformers(tmp_path) is None


def test_a_module_we_cannot_apply_is_named(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, ["Transformer", "Pooling", "Dense"], {"pooling_mode_cls_token": True})
    with pytest.raises(UnsupportedPipeline, match="sentence_transformers.models.Dense"):
        read_sentence_transformers(path)


@pytest.mark.parametrize(
    "pooling",
    [
        {},
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
        {"pooling_mode_weightedmean_tokens": True},
    ],
)
def test_pooling_modes_we_cannot_apply(tmp_path: Path, pooling: dict[str, bool]) -> None:
    with pytest.raises(UnsupportedPipeline):
        read_sentence_transformers(_pipeline(tmp_path, ["Transformer", "Pooling"], pooling))
