"""Cross-encoders: a batch of pairs scores each pair as it scores alone (an encoder, and a decoder classifier found
by its padding token), the activation as sentence-transformers reads it, and how the kind is told from the config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

from transformers_openai.embedding_loader import cross_encoder_activation, is_cross_encoder
from transformers_openai.engine.embedding_engine import TokenPair
from transformers_openai.model_loader import detect_kind
from transformers_openai.runners.cross_encoder import CrossEncoderRunner

VOCAB = 100


def tiny_bert() -> Any:
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        initializer_range=0.5,
    )
    config.num_labels = 1
    torch.manual_seed(0)
    return BertForSequenceClassification(config).eval()


def tiny_llama_classifier() -> Any:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        initializer_range=0.5,
    )
    config.num_labels = 1
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config).eval()


def pairs(count: int = 6) -> list[TokenPair]:
    """Pairs of different lengths (ids from 2 up: 0 pads), the second segment typed 1."""
    generator = torch.Generator().manual_seed(1)
    found = []
    for n in range(count):
        first, second = 2 + n, 3 + 4 * n
        ids = torch.randint(2, VOCAB, (first + second,), generator=generator).tolist()
        found.append(TokenPair(ids, [0] * first + [1] * second))
    return found


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama_classifier], ids=["bert", "llama"])
def test_a_batch_scores_each_pair_as_it_scores_alone(build: Any) -> None:
    model = build()
    runner = CrossEncoderRunner(model, "identity", pad_token_id=0)
    batch = pairs()
    together = runner.embed(batch)
    assert together.shape == (len(batch), 1) and together.dtype == torch.float32
    with torch.inference_mode():
        for row, pair in enumerate(batch):
            inputs: dict[str, Any] = {"input_ids": torch.tensor([pair.ids])}
            if runner.takes_token_types:
                inputs["token_type_ids"] = torch.tensor([pair.type_ids])
            alone = model(**inputs).logits[0, 0]
            assert abs(float(together[row, 0]) - float(alone)) < 1e-5, row
    spread = together[:, 0]
    assert float(spread.max() - spread.min()) > 0.1  # the pairs' scores differ: a lost pairing would show


def test_token_types_reach_a_model_that_takes_them() -> None:
    runner = CrossEncoderRunner(tiny_bert(), "identity", pad_token_id=0)
    pair = pairs(1)[0]
    untyped = TokenPair(pair.ids, None)
    assert runner.takes_token_types
    assert float(runner.embed([pair])[0, 0]) != pytest.approx(float(runner.embed([untyped])[0, 0]), abs=1e-4)


def test_the_activation_applies_to_the_logit() -> None:
    model = tiny_bert()
    logits = CrossEncoderRunner(model, "identity", 0).embed(pairs())
    assert torch.allclose(CrossEncoderRunner(model, "sigmoid", 0).embed(pairs()), torch.sigmoid(logits), atol=1e-6)
    assert torch.allclose(CrossEncoderRunner(model, "tanh", 0).embed(pairs()), torch.tanh(logits), atol=1e-6)


def classifier_config(**extra: Any) -> BertConfig:
    config = BertConfig(architectures=["BertForSequenceClassification"], **extra)
    config.num_labels = 1
    return config


def test_a_one_label_classifier_is_a_cross_encoder_whatever_else_its_directory_holds() -> None:
    config = classifier_config()
    assert is_cross_encoder(config)
    assert detect_kind(config, sentence_transformers=True) == "cross-encoder"  # sentence-transformers v6 saves one
    two_labels = BertConfig(architectures=["BertForSequenceClassification"])  # a classifier of two classes
    assert not is_cross_encoder(two_labels) and detect_kind(two_labels) == "embedding"
    assert not is_cross_encoder(BertConfig(architectures=["BertModel"]))
    assert detect_kind(BertConfig(architectures=["BertModel"]), override="cross-encoder") == "cross-encoder"


def test_the_activation_is_read_where_sentence_transformers_keeps_it(tmp_path: Path) -> None:
    model = str(tmp_path)
    assert cross_encoder_activation(model, classifier_config()) == "sigmoid"  # CrossEncoder's default for one label
    identity = "torch.nn.modules.linear.Identity"
    assert cross_encoder_activation(model, classifier_config(sentence_transformers={"activation_fn": identity})) == (
        "identity"
    )
    assert cross_encoder_activation(model, classifier_config(sbert_ce_default_activation_function=identity)) == (
        "identity"
    )
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.activation.Tanh"})
    )
    config = classifier_config(sentence_transformers={"activation_fn": identity})
    assert cross_encoder_activation(model, config) == "tanh"  # v6's file comes first, as it does for CrossEncoder
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": "my.module.Swish"}))
    with pytest.raises(ValueError, match="my.module.Swish"):
        cross_encoder_activation(model, config)


def test_a_model_without_a_one_label_head_cannot_be_served_as_a_cross_encoder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_labels 1"):
        cross_encoder_activation(str(tmp_path), BertConfig(architectures=["BertModel"]))
