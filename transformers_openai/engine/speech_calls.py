"""A speech runner's work outside the batch, run on the engine thread between two steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transformers_openai.engine.engine_thread import EngineThread
from transformers_openai.runners.base import Features, SpeechRunner
from transformers_openai.runners.lora.layers import LoraWeightsLike


class SpeechCalls:
    """Language detection, word alignment and the release of kept windows, each awaited from the event loop while
    the engine thread runs it between steps (the model is never used by two threads)."""

    def __init__(self, engine: EngineThread, runner: SpeechRunner) -> None:
        self._engine = engine
        self._runner = runner

    async def detect_language(
        self,
        features: Features,
        sot: int,
        language_tokens: Sequence[int],
        window: tuple[str, int] | None = None,
        lora: LoraWeightsLike | None = None,
    ) -> int:
        """The likeliest language token after `sot` for one window (its encoder output kept for `window`), with the
        transcription's LoRA adapter, if any."""
        return await self._engine.call(
            lambda: self._runner.detect_language(features, sot, language_tokens, window, lora)
        )

    async def alignment_weights(
        self, features: Features, tokens: list[int], lora: LoraWeightsLike | None = None
    ) -> torch.Tensor:
        """The alignment heads' cross-attention over one teacher-forced pass of `tokens` (with `lora`, if any)."""
        return await self._engine.call(lambda: self._runner.alignment_weights(features, tokens, lora))

    async def release_windows(self, key: str) -> None:
        """Drops what the runner kept for the transcription `key`."""
        await self._engine.call(lambda: self._runner.release_windows(key))
