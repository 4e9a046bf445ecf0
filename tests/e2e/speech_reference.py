"""What transformers itself (or PEFT, with a LoRA adapter) transcribes from a clip alone, and the word error rate to
score text with."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, WhisperFeatureExtractor, WhisperForConditionalGeneration


@lru_cache(maxsize=1)
def _load(
    model_dir: str,
) -> tuple[WhisperForConditionalGeneration, PreTrainedTokenizerBase, WhisperFeatureExtractor]:
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.set_num_threads(1)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir), WhisperFeatureExtractor.from_pretrained(model_dir)


def samples(path: Path) -> np.ndarray:
    import librosa

    audio, _ = librosa.load(path, sr=16000, mono=True)
    return np.asarray(audio, dtype=np.float32)


@lru_cache(maxsize=16)
def generate_text(model_dir: Path, clip: Path) -> str:
    """`model.generate` with timestamps on the clip alone: one window, or transformers' sequential long-form."""
    model, tokenizer, features = _load(str(model_dir))
    return _generate(model, tokenizer, features, clip)


@lru_cache(maxsize=2)
def _peft_model(model_dir: str, adapter: str) -> Any:
    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    base = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter).eval()  # its own copy: PEFT wraps the layers of the model given


@lru_cache(maxsize=8)
def peft_generate_text(model_dir: Path, adapter: Path, clip: Path) -> str:
    """As `generate_text`, with the LoRA adapter at `adapter` applied by PEFT (`PeftModel.generate`)."""
    _, tokenizer, features = _load(str(model_dir))
    return _generate(_peft_model(str(model_dir), str(adapter)), tokenizer, features, clip)


def _generate(model: Any, tokenizer: PreTrainedTokenizerBase, features: WhisperFeatureExtractor, clip: Path) -> str:
    audio = samples(clip)
    long_form = audio.size > 30 * 16000
    inputs = features(
        audio,
        sampling_rate=16000,
        return_tensors="pt",
        return_attention_mask=long_form,
        truncation=not long_form,  # the extractor's defaults (one padded 30 s window) unless long-form
        padding="longest" if long_form else "max_length",
    )
    with torch.inference_mode():
        out = model.generate(inputs.input_features, attention_mask=inputs.get("attention_mask"), return_timestamps=True)
    return str(tokenizer.decode(out[0], skip_special_tokens=True)).strip()


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        previous, row[0] = row[:], i
        for j in range(1, len(hyp) + 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (ref[i - 1] != hyp[j - 1]))
    return row[-1] / len(ref)


def silences(audio: np.ndarray, min_s: float = 0.3) -> list[tuple[float, float]]:
    """Stretches of near silence (100 ms frames under 1% of the loudest), at least `min_s` long."""
    frame = 1600
    rms = np.sqrt((audio[: audio.size // frame * frame].reshape(-1, frame) ** 2).mean(1))
    quiet = rms < 0.01 * rms.max()
    spans, start = [], None
    for i, still in enumerate([*quiet, False]):
        if still and start is None:
            start = i
        elif not still and start is not None:
            if (i - start) * 0.1 >= min_s - 1e-9:
                spans.append((start * 0.1, i * 0.1))
            start = None
    return spans
