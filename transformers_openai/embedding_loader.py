"""Loads an embedding model (a sentence-transformers directory, a BERT-family encoder, or a decoder served for
embeddings) or a cross-encoder (a sequence classifier with one label) and wires its runner, engine and serving
context: both run on the embedding engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils.hub import cached_file

from transformers_openai.engine.embedding_engine import (
    CPU_FORWARD_COST_TOKENS,
    GPU_FORWARD_COST_TOKENS,
    Embedder,
    EmbeddingEngine,
    In,
    TokenPair,
)
from transformers_openai.runners.cross_encoder import Activation, CrossEncoderRunner
from transformers_openai.runners.embedding import EmbeddingRunner
from transformers_openai.runners.pooling import PoolingSpec, read_sentence_transformers
from transformers_openai.serving.context import Capability, CrossEncoderModel, EmbeddingModel, ServingContext
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.tokenizer import TokenizerService
from transformers_openai.settings import Settings

logger = logging.getLogger(__name__)

# Encoders whose base model gives token states to pool (detected as embedding models without --model-kind).
ENCODER_TYPES = frozenset(
    {
        "bert",
        "roberta",
        "xlm-roberta",
        "distilbert",
        "mpnet",
        "electra",
        "camembert",
        "albert",
        "deberta",
        "deberta-v2",
        "modernbert",
        "nomic_bert",
        "new",
    }
)
_SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json")
CROSS_ENCODER = "cross-encoder"
# The activations a cross-encoder's config may name (sentence-transformers writes torch's class path), by class name.
_ACTIVATIONS: dict[str, Activation] = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


def sentence_transformers_dir(model: str) -> Path | None:
    """The directory holding `model`'s sentence-transformers pipeline (`modules.json`), or None without one."""
    if Path(model).is_dir():
        return Path(model) if (Path(model) / "modules.json").is_file() else None
    quietly = {"_raise_exceptions_for_missing_entries": False, "_raise_exceptions_for_connection_errors": False}
    found = [cached_file(model, name, **quietly) for name in _SENTENCE_TRANSFORMERS_FILES]
    return Path(found[0]).parent if found[0] else None


def pooling_spec(model: str, config: PretrainedConfig) -> PoolingSpec:
    """The pooling the model's directory declares; without one: CLS for an encoder (as BERT's pooler reads it),
    the last token for a decoder; both normalized, as vLLM serves such models by default."""
    directory = sentence_transformers_dir(model)
    declared = read_sentence_transformers(directory) if directory is not None else None
    if declared is not None:
        return declared
    return PoolingSpec(mode="cls" if config.model_type in ENCODER_TYPES else "last", normalize=True)


def input_limit(config: PretrainedConfig, tokenizer: Any, spec: PoolingSpec | None, requested: int | None) -> int:
    """The longest input served: the pipeline's max_seq_length, else the model's positions (and the tokenizer's
    limit); --max-model-len may lower it."""
    text_config = config.get_text_config(decoder=True)
    limits = [int(getattr(text_config, "max_position_embeddings", 0) or 0)]
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < 1_000_000:
        limits.append(tokenizer_limit)
    if spec is not None and spec.max_length:
        limits.append(spec.max_length)
    native = min(limit for limit in limits if limit > 0) if any(limits) else 512
    if requested is None:
        return native
    if requested > native:
        raise ValueError(f"--max-model-len {requested} is longer than the model's {native} input tokens")
    return requested


def matryoshka(config: PretrainedConfig) -> tuple[bool, tuple[int, ...] | None]:
    """Whether the model may be cut to fewer dimensions, and to which (its config's `matryoshka_dimensions` or
    `is_matryoshka`, the keys vLLM reads)."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return True, tuple(int(d) for d in dims)
    return bool(getattr(config, "is_matryoshka", False)), None


def embedding_pooling(settings: Settings, config: PretrainedConfig) -> PoolingSpec:
    """How the model's token states become one vector; a model that cannot be served for embeddings is refused
    here, before its weights are loaded."""
    if getattr(config, "is_encoder_decoder", False) or config.model_type == "whisper":
        raise ValueError(
            f"--model-kind embedding serves encoders (BERT family) and decoders, not {config.model_type}: "
            "an encoder-decoder model has no single stack of token states to pool"
        )
    return pooling_spec(settings.model, config)


def is_cross_encoder(config: PretrainedConfig) -> bool:
    """A sequence classifier with one label (the shape of the ms-marco MiniLM and BGE rerankers): a cross-encoder,
    served on /v1/rerank and /v1/score."""
    architectures = getattr(config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures) and config.num_labels == 1


def cross_encoder_activation(model: str, config: PretrainedConfig) -> Activation:
    """What turns the cross-encoder's logit into its score, as sentence-transformers' CrossEncoder reads it: the
    activation its files name, else a sigmoid (CrossEncoder's default for one label). A model that is no
    cross-encoder, or names another activation, is refused here, before its weights are loaded."""
    if not is_cross_encoder(config):
        raise ValueError(
            "--model-kind cross-encoder serves sequence classifiers with one label (a *ForSequenceClassification "
            f"architecture, num_labels 1); this model's config has {getattr(config, 'architectures', None)} with "
            f"{config.num_labels} labels"
        )
    path = _declared_activation(model, config)
    if path is None:
        return "sigmoid"
    activation = _ACTIVATIONS.get(path.rsplit(".", 1)[-1])
    if activation is None:
        raise ValueError(
            f"the cross-encoder's files name the activation {path}: this server applies {list(_ACTIVATIONS)}"
        )
    return activation


def _declared_activation(model: str, config: PretrainedConfig) -> str | None:
    """The activation's class path where sentence-transformers keeps it, in the order it reads them:
    config_sentence_transformers.json (v6), the config's `sentence_transformers` (v4, v5), its
    `sbert_ce_default_activation_function` (before v4)."""
    found = _model_file(model, "config_sentence_transformers.json")
    if found is not None:
        value = json.loads(found.read_text()).get("activation_fn")
        if isinstance(value, str):
            return value
    declared = getattr(config, "sentence_transformers", None)
    if isinstance(declared, dict) and isinstance(declared.get("activation_fn"), str):
        return str(declared["activation_fn"])
    older = getattr(config, "sbert_ce_default_activation_function", None)
    return older if isinstance(older, str) else None


def _model_file(model: str, name: str) -> Path | None:
    """A file of the model's directory (or of its hub cache), None when it has none."""
    if Path(model).is_dir():
        path = Path(model) / name
        return path if path.is_file() else None
    quietly = {"_raise_exceptions_for_missing_entries": False, "_raise_exceptions_for_connection_errors": False}
    found = cached_file(model, name, **quietly)
    return Path(found) if found else None


def embedding_context(
    settings: Settings, config: PretrainedConfig, tokenizer: Any, model: PreTrainedModel, spec: PoolingSpec
) -> ServingContext:
    """The serving context of an embedding model whose weights are loaded (runs in a worker thread, like
    load_serving_context)."""
    max_len = input_limit(config, tokenizer, spec, settings.max_model_len)
    runner = EmbeddingRunner(model, spec, pad_token_id=int(tokenizer.pad_token_id or 0))
    runner.embed([tokenizer("warm up")["input_ids"]])  # oneDNN's first-call set-up; a model that cannot run fails now
    engine = _engine(settings, runner, model)
    is_matryoshka, dims = matryoshka(config)
    logger.info(
        "loaded %s (embedding: %s pooling%s, %d dimensions) on %s as %s, inputs up to %d tokens",
        settings.model,
        spec.mode,
        ", normalized" if spec.normalize else "",
        runner.width,
        model.device,
        model.dtype,
        max_len,
    )
    return _context(
        settings,
        engine,
        tokenizer,
        max_len,
        "embedding",
        capabilities=frozenset({Capability.EMBEDDINGS, Capability.SCORES}),
        embeddings=EmbeddingModel(
            engine=engine,
            max_input_len=max_len,
            width=runner.width,
            normalized=spec.normalize,
            matryoshka=is_matryoshka,
            matryoshka_dims=dims,
            max_total_tokens=settings.max_embedding_tokens,
        ),
    )


def cross_encoder_context(
    settings: Settings, config: PretrainedConfig, tokenizer: Any, model: PreTrainedModel, activation: Activation
) -> ServingContext:
    """The serving context of a cross-encoder whose weights are loaded (runs in a worker thread)."""
    max_len = input_limit(config, tokenizer, None, settings.max_model_len)
    runner = CrossEncoderRunner(model, activation, _pad_token_id(model, tokenizer))
    warm = tokenizer("warm", "up")
    runner.embed([TokenPair(list(warm["input_ids"]), warm.get("token_type_ids"))])  # fails now if it cannot run
    engine: EmbeddingEngine[TokenPair] = _engine(settings, runner, model)
    logger.info(
        "loaded %s (cross-encoder, %s of its logit) on %s as %s, pairs up to %d tokens",
        settings.model,
        activation,
        model.device,
        model.dtype,
        max_len,
    )
    return _context(
        settings,
        engine,
        tokenizer,
        max_len,
        CROSS_ENCODER,
        capabilities=frozenset({Capability.SCORES}),
        cross_encoder=CrossEncoderModel(engine, max_len, settings.max_embedding_tokens),
    )


def _pad_token_id(model: PreTrainedModel, tokenizer: Any) -> int:
    """The id rows are padded with. A decoder's classifier finds each row's last token by it, so the config must
    name one (the tokenizer's, where the config has none)."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
    if pad is None and model.config.model_type not in ENCODER_TYPES:
        raise ValueError(
            f"{model.config.model_type} classifies a row by its last token, found by the padding token, and neither "
            "its config nor its tokenizer names one: it cannot score pairs in batches"
        )
    model.config.pad_token_id = pad
    return int(pad or 0)


def _engine(settings: Settings, runner: Embedder[In], model: PreTrainedModel) -> EmbeddingEngine[In]:
    threads = torch.get_num_threads() if model.device.type == "cpu" else 1
    # Requests in flight at most: --max-batch-size + --max-queue, as the generation engine admits them.
    rows = settings.batch_rows("embedding")
    return EmbeddingEngine(
        runner,
        max_rows=rows,
        max_tokens=settings.max_prefill_tokens,
        max_requests=rows + settings.max_queue,
        threads=threads,
        forward_cost=CPU_FORWARD_COST_TOKENS if model.device.type == "cpu" else GPU_FORWARD_COST_TOKENS,
    )


def _context(
    settings: Settings,
    engine: EmbeddingEngine[Any],
    tokenizer: Any,
    max_len: int,
    kind: str,
    capabilities: frozenset[Capability],
    embeddings: EmbeddingModel | None = None,
    cross_encoder: CrossEncoderModel | None = None,
) -> ServingContext:
    tokenizer_service = TokenizerService(tokenizer)
    # /tokenize's bounds, and the characters a token stands for at most (the cheap check of every input's length).
    rows = settings.batch_rows(kind)
    limits = PromptLimits(
        max_messages=settings.max_chat_messages,
        max_content_parts=settings.max_content_parts,
        max_prompt_tokens=max_len,
        max_token_chars=tokenizer_service.longest_token_chars(),
        max_sequences=rows + settings.max_queue,
    )
    return ServingContext(
        engine=engine,
        tokenizer=tokenizer_service,
        model_name=settings.model_name,
        model_aliases=frozenset({settings.model_name, settings.model}),
        max_model_len=max_len,
        model_kind=kind,
        max_input_len=max_len,
        capabilities=capabilities,
        prompt_limits=limits,
        embeddings=embeddings,
        cross_encoder=cross_encoder,
    )
