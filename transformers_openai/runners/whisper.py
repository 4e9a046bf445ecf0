"""Runner for Whisper (WhisperForConditionalGeneration): one row per 30 s window of audio."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import EncoderDecoderCache, PreTrainedModel

from transformers_openai.runners.base import (
    Acceleration,
    Features,
    LogitsProcessor,
    PrefillOutput,
    PrefillRow,
    Prepared,
)
from transformers_openai.runners.kernels.cross_attention import use_cross_in_place
from transformers_openai.runners.kv.kv_cache import cache_keyword
from transformers_openai.runners.kv.kv_pool import KVSpace
from transformers_openai.runners.kv.paged_cache import StepPlan
from transformers_openai.runners.lora.layers import LoraWeightsLike
from transformers_openai.runners.seq2seq import Seq2SeqRunner
from transformers_openai.runners.whisper_rules import WhisperRules, WhisperRuleTokens

logger = logging.getLogger(__name__)

# Mel frames the encoder takes: one 30 s window.
WINDOW_FRAMES = 3000

# A window of a transcription: the key the server made for the transcription (never one a client chose: a kept
# encoder output is reused on its key alone) and the window's number in it.
WindowKey = tuple[str, int]


class WhisperRunner(Seq2SeqRunner):
    """Encodes a window's log-mel features once at admission; its forced prefix is the decoder's prompt.

    Each row keeps its window's cross-attention K/V (all encoder positions are real audio, no mask) and
    its decoder self-attention K/V; Whisper's learned positions need each row's own position id.
    A request's `encoder_inputs["input_features"]` is `[n_mels, 3000]`; its prompt is the forced prefix
    (`<|startofprev|>` + previous text, `<|startoftranscript|>`, language, task, `<|notimestamps|>`), which starts
    with its own start token.
    A request may name its window (`encoder_inputs["window"]`: a `WindowKey`, the transcription's server-made key and
    the window's number): its encoder output is then kept for a retry of the same window (temperature fallback), one
    window per transcription (its next window replaces it), until `release_windows` drops it when the transcription
    ends; the `max_rows` most recent transcriptions at most. A kept output is reused only by a row with the adapter
    it was encoded with (its LoRA adapter, or none).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_rows: int,
        logits_processors: Sequence[LogitsProcessor] = (),
        kv: KVSpace | None = None,
    ) -> None:
        config = model.config
        max_target, max_source = int(config.max_target_positions), int(config.max_source_positions)
        super().__init__(model, max_rows, max_target, max_source, kv, logits_processors)
        generation = model.generation_config
        self._sot = int(generation.decoder_start_token_id)
        self._no_speech = _no_speech_token(generation)
        # transcription -> its window: its number, the adapter it was encoded with, the encoder's output
        self._encoded: OrderedDict[str, tuple[int, LoraWeightsLike | None, torch.Tensor]] = OrderedDict()
        self._encoded_now: dict[int, torch.Tensor] = {}  # slot -> its window's encoder states from this step's batch
        self._model_cache_keyword = cache_keyword(model.model)  # the prefill calls the encoder-decoder without its head

    @classmethod
    def with_rules(cls, model: PreTrainedModel, max_rows: int, kv: KVSpace | None = None) -> WhisperRunner:
        """A runner applying Whisper's decoding rules as the model's generation config states them."""
        generation = model.generation_config
        eot = generation.eos_token_id
        tokens = WhisperRuleTokens(
            eot=int(eot if isinstance(eot, int) else eot[0]),
            no_timestamps=int(getattr(generation, "no_timestamps_token_id")),  # noqa: B009 (not typed by transformers)
            suppress=tuple(int(t) for t in generation.suppress_tokens or ()),
            begin_suppress=tuple(int(t) for t in generation.begin_suppress_tokens or ()),
            max_initial_timestamp_index=getattr(generation, "max_initial_timestamp_index", 50),
        )
        return cls(model, max_rows, [WhisperRules(tokens, int(model.config.vocab_size), model.device)], kv)

    @staticmethod
    def _decoder_start(model: PreTrainedModel) -> int | None:
        return None  # the forced prefix starts with its own start token

    def prepare(self, acceleration: Acceleration) -> Prepared:
        store = acceleration.store
        if acceleration.kernels and store is not None and self.read_cross_in_place(store):
            return Prepared(("cross-attention kernel",))
        return Prepared()

    def read_cross_in_place(self, directory: Path) -> bool:
        """Decode steps' cross-attention through the kernel that reads each row's K/V as kept (`cross_attention.py`,
        built in `directory` or loaded from there), the keys kept transposed for it; before any row joins. False
        (nothing changed) where the kernel cannot serve this model. Whisper's alone: its cross-attention is
        unmasked (every encoder position is audio), where T5's masks padded inputs and would stay with sdpa."""
        if self._cross_cache.rows or not use_cross_in_place(self.model, directory):
            return False
        self._cross_cache.transpose_keys()
        return True

    def prefill_cost(self, encoder_inputs: Mapping[str, Any]) -> int:
        """The encoder pass over the window's 1500 positions, unless a retry of the window reuses it."""
        window: WindowKey | None = encoder_inputs.get("window")
        return 0 if window is not None and window in self.kept_windows() else self.max_input_len

    def _prefill(self, rows: Sequence[PrefillRow]) -> list[PrefillOutput | Exception]:
        """The windows admitted together that need an encoder pass share one batched call; then each joins."""
        fresh = [row for row in rows if self._kept(row.encoder_inputs.get("window"), row.lora) is None]
        if len(fresh) > 1:
            try:
                batch = torch.cat([self._features(row.encoder_inputs) for row in fresh])
                with self._adapters([row.lora for row in fresh]):
                    hidden = self.model.model.encoder(input_features=batch)
            except Exception:  # e.g. one window of the wrong shape: each is encoded alone, and fails alone
                logger.warning("batched encoder pass failed; encoding its %d windows alone", len(fresh), exc_info=True)
            else:
                for row, states in zip(fresh, hidden.last_hidden_state, strict=True):
                    self._encoded_now[row.slot] = states[None].clone()  # its own: a kept window must not hold all
        try:
            return super()._prefill(rows)
        finally:
            self._encoded_now.clear()

    def _features(self, encoder_inputs: Mapping[str, Any]) -> torch.Tensor:
        features = torch.as_tensor(encoder_inputs["input_features"], device=self.device, dtype=self.model.dtype)
        if features.dim() == 2:
            features = features.unsqueeze(0)
        if features.shape[-1] != WINDOW_FRAMES:
            raise ValueError(f"Whisper takes windows of {WINDOW_FRAMES} mel frames, got {features.shape[-1]}")
        return features

    def _prefill_forward(self, row: PrefillRow, own_cache: EncoderDecoderCache, info: dict[str, float]) -> torch.Tensor:
        encoded = self._encoded_now.pop(row.slot, None)  # the batched encoder pass's output, if this step made one
        window: WindowKey | None = row.encoder_inputs.get("window")
        if encoded is None:
            encoded = self._encode(self._features(row.encoder_inputs), window, row.lora)
        elif window is not None:
            self._remember(window, row.lora, encoded)
        prefix = list(row.tokens)
        out = self.model.model(
            encoder_outputs=(encoded,),
            decoder_input_ids=torch.tensor([prefix], device=self.device),
            use_cache=True,
            **{self._model_cache_keyword: own_cache},
        )
        # Logits only where they are read: after <|startoftranscript|> (no-speech) and after the prefix.
        sot_index = prefix.index(self._sot) if self._sot in prefix else 0
        hidden = out.last_hidden_state[0, [sot_index, len(prefix) - 1]]
        head: torch.nn.Module = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        logits = head(hidden).float()
        if self._no_speech is not None:
            info["no_speech_prob"] = float(logits[0].softmax(-1)[self._no_speech])
        next_logits: torch.Tensor = logits[1]
        return next_logits

    def _encode(self, features: torch.Tensor, window: WindowKey | None, lora: LoraWeightsLike | None) -> torch.Tensor:
        """The window's encoder output, with `lora` (called inside the forwards' adapters: see `_adapters`)."""
        kept = self._kept(window, lora)
        if kept is not None:
            return kept
        hidden: torch.Tensor = self.model.model.encoder(input_features=features).last_hidden_state
        if window is not None:
            self._remember(window, lora, hidden)
        return hidden

    def _kept(self, window: WindowKey | None, lora: LoraWeightsLike | None) -> torch.Tensor | None:
        """The encoder output kept for exactly this window of this transcription encoded with `lora`, if any."""
        if window is None:
            return None
        key, number = window
        kept = self._encoded.get(key)
        if kept is None or kept[0] != number or kept[1] is not lora:
            return None
        self._encoded.move_to_end(key)
        return kept[2]

    def _remember(self, window: WindowKey, lora: LoraWeightsLike | None, hidden: torch.Tensor) -> None:
        key, number = window
        self._encoded[key] = (number, lora, hidden)  # a transcription's earlier windows are done with: replaced
        self._encoded.move_to_end(key)
        while len(self._encoded) > self.spec.max_rows:
            self._encoded.popitem(last=False)

    def release_windows(self, key: str) -> None:
        """Drops what was kept for the transcription `key` (it ended: finished, failed or aborted)."""
        self._encoded.pop(key, None)

    def kept_windows(self) -> list[WindowKey]:
        """The windows whose encoder output is kept, oldest first."""
        return [(key, number) for key, (number, _, _) in self._encoded.items()]

    def _step_inputs(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        return {"decoder_position_ids": plan.positions}

    @torch.inference_mode()
    def detect_language(
        self,
        features: Features,
        sot: int,
        language_tokens: Sequence[int],
        window: WindowKey | None = None,
        lora: LoraWeightsLike | None = None,
    ) -> int:
        """The likeliest language token after `<|startoftranscript|>` for one window (runs outside the batch), with
        the transcription's LoRA adapter `lora`, if any.

        With `window`, the encoder output is kept for that window's prefill, which then does not encode again.
        """
        decoder_input_ids = torch.tensor([[sot]], device=self.device)
        with self._adapters([lora]):
            encoded = self._encode(self._features({"input_features": features}), window, lora)
            out = self.model(encoder_outputs=(encoded,), decoder_input_ids=decoder_input_ids)
        candidates = torch.tensor(list(language_tokens), device=self.device)
        return int(candidates[out.logits[0, -1, candidates].argmax()])

    @torch.inference_mode()
    def alignment_weights(
        self, features: Features, tokens: list[int], lora: LoraWeightsLike | None = None
    ) -> torch.Tensor:
        """Cross-attention of the alignment heads over one teacher-forced pass of `tokens` (for word times), with the
        transcription's LoRA adapter `lora`, if any.

        Returns `[heads, len(tokens), 1500]` attention probabilities: row i is what the decoder attends to
        while reading `tokens[i]`. Computed from the heads' own queries and keys, captured with hooks, so it
        needs no eager attention and leaves the shared model as it was. Runs outside the batch (no row).
        """
        heads = self._alignment_heads()
        captured: dict[tuple[int, str], torch.Tensor] = {}
        layers = self.model.model.decoder.layers
        hooks = []
        for layer in sorted({layer for layer, _ in heads}):
            attention = layers[layer].encoder_attn
            hooks += [_capture(getattr(attention, name), (layer, name), captured) for name in ("q_proj", "k_proj")]
        try:
            features = torch.as_tensor(features, device=self.device, dtype=self.model.dtype)
            with self._adapters([lora]):
                self.model.model(
                    input_features=features.reshape(1, -1, WINDOW_FRAMES),
                    decoder_input_ids=torch.tensor([tokens], device=self.device),
                    use_cache=False,
                )
        finally:
            for hook in hooks:
                hook.remove()
        config = self.model.config
        n_heads, head_dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
        weights = []
        for layer, head in heads:
            q = captured[(layer, "q_proj")][0].view(-1, n_heads, head_dim)[:, head].float() * head_dim**-0.5
            k = captured[(layer, "k_proj")][0].view(-1, n_heads, head_dim)[:, head].float()
            weights.append((q @ k.T).softmax(dim=-1))
        return torch.stack(weights)

    def _alignment_heads(self) -> list[tuple[int, int]]:
        """The model's alignment heads; without them, every head of the second half of the decoder layers."""
        heads = getattr(self.model.generation_config, "alignment_heads", None)
        if heads:
            return [(int(layer), int(head)) for layer, head in heads]
        config = self.model.config
        layers = range(config.decoder_layers // 2, config.decoder_layers)
        return [(layer, head) for layer in layers for head in range(config.decoder_attention_heads)]


def _capture(
    module: torch.nn.Module, key: tuple[int, str], into: dict[tuple[int, str], torch.Tensor]
) -> torch.utils.hooks.RemovableHandle:
    """Keeps the module's next output in `into[key]`."""

    def keep(_: torch.nn.Module, __: object, out: torch.Tensor) -> None:
        into[key] = out

    return module.register_forward_hook(keep)


def _no_speech_token(generation_config: object) -> int | None:
    """The `<|nospeech|>` (older vocabularies: `<|nocaptions|>`) token, if the generation config names it."""
    token = getattr(generation_config, "no_speech_token_id", None)
    if token is None:
        # English-only vocabularies put <|nocaptions|> just before <|notimestamps|>.
        no_timestamps = getattr(generation_config, "no_timestamps_token_id", None)
        token = None if no_timestamps is None else int(no_timestamps) - 1
    return None if token is None else int(token)
