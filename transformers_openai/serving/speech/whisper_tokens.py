"""Whisper's special tokens for one model, and the forced prefix of a window built from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers.models.whisper.tokenization_whisper import LANGUAGES

# At most this many tokens of earlier text are carried into a window's prefix (half the decoder, minus one).
MAX_PREVIOUS_TOKENS = 223


@dataclass(frozen=True)
class WhisperTokens:
    """Token ids of one Whisper vocabulary. English-only models have no language or task in their prefix."""

    sot: int
    eot: int
    sot_prev: int
    no_timestamps: int
    no_speech: int
    transcribe: int
    translate: int
    languages: Mapping[str, int]  # ISO-639-1 code -> token id; empty for English-only models

    @property
    def timestamp_begin(self) -> int:
        """`<|0.00|>`: timestamp tokens follow `<|notimestamps|>`, one per 0.02 s."""
        return self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)

    def prefix(self, *, language: str | None, task: str, timestamps: bool, previous: list[int]) -> list[int]:
        """The forced start of a window's decoder input.

        Args:
            language: ISO-639-1 code (multilingual models only; None leaves it to the model).
            task: "transcribe" or "translate" (multilingual models only).
            timestamps: whether the window is decoded with timestamp tokens.
            previous: text tokens of the prompt or of earlier windows; the last 223 are carried.
        """
        tokens: list[int] = []
        carried = previous[-MAX_PREVIOUS_TOKENS:]
        if carried:
            tokens += [self.sot_prev, *carried]
        tokens.append(self.sot)
        if self.multilingual:
            if language is not None:
                tokens.append(self.languages[language])
            tokens.append(self.translate if task == "translate" else self.transcribe)
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, multilingual: bool) -> WhisperTokens:
        vocab: dict[str, int] = tokenizer.get_vocab()

        def token(*names: str) -> int:
            for name in names:
                if name in vocab:
                    return vocab[name]
            raise ValueError(f"the tokenizer has none of {names}: not a Whisper vocabulary")

        languages = {code: vocab[f"<|{code}|>"] for code in LANGUAGES if f"<|{code}|>" in vocab} if multilingual else {}
        return cls(
            sot=token("<|startoftranscript|>"),
            eot=token("<|endoftext|>"),
            sot_prev=token("<|startofprev|>"),
            no_timestamps=token("<|notimestamps|>"),
            no_speech=token("<|nospeech|>", "<|nocaptions|>"),
            transcribe=token("<|transcribe|>"),
            translate=token("<|translate|>"),
            languages=languages,
        )


def language_name(code: str) -> str:
    """The full lower-case English name OpenAI reports (`en` -> `english`)."""
    return LANGUAGES.get(code, code)
