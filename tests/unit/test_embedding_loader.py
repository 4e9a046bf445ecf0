"""Which models are served for embeddings, with which pooling and input limit (configs only, no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import BertConfig, LlamaConfig, T5Config

from transformers_openai.embedding_loader import input_limit, matryoshka, pooling_spec
from transformers_openai.model_loader import detect_kind
from transformers_openai.runners.pooling import PoolingSpec


def test_detect_kind() -> None:
    assert detect_kind(BertConfig()) == "embedding"
    assert detect_kind(LlamaConfig()) == "causal-lm"
    assert detect_kind(LlamaConfig(), sentence_transformers=True) == "embedding"  # e.g. a last-token pipeline
    assert detect_kind(LlamaConfig(), "embedding") == "embedding"
    assert detect_kind(T5Config()) == "seq2seq"


def test_default_pooling_without_a_pipeline(tmp_path: Path) -> None:
    assert pooling_spec(str(tmp_path), BertConfig()) == PoolingSpec(mode="cls", normalize=True)
    assert pooling_spec(str(tmp_path), LlamaConfig()) == PoolingSpec(mode="last", normalize=True)


def test_the_pipeline_wins(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "p", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert pooling_spec(str(tmp_path), BertConfig()) == PoolingSpec(mode="last", normalize=False)


def test_input_limit() -> None:
    tokenizer = SimpleNamespace(model_max_length=512)
    config = BertConfig(max_position_embeddings=512)
    assert input_limit(config, tokenizer, PoolingSpec("mean", True, max_length=256), None) == 256
    assert input_limit(config, tokenizer, PoolingSpec("mean", True), None) == 512
    assert input_limit(config, SimpleNamespace(model_max_length=10**30), PoolingSpec("cls", True), 100) == 100
    with pytest.raises(ValueError, match="longer than the model's 256"):
        input_limit(config, tokenizer, PoolingSpec("mean", True, max_length=256), 300)


def test_matryoshka_from_the_config() -> None:
    assert matryoshka(BertConfig()) == (False, None)
    # Keys a checkpoint's config.json may carry, which BertConfig's own signature does not name.
    assert matryoshka(BertConfig.from_dict({"is_matryoshka": True})) == (True, None)
    assert matryoshka(BertConfig.from_dict({"matryoshka_dimensions": [64, 128]})) == (True, (64, 128))
