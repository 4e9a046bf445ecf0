"""Runner for encoder-decoder text models such as T5 (AutoModelForSeq2SeqLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from transformers_openai.runners.base import LogitsProcessor, OneByOnePrefill, PrefillJob, PrefillResult
from transformers_openai.runners.cross_cache import CrossKVCache
from transformers_openai.runners.kv_cache import BatchKVCache, layer_tensors
from transformers_openai.runners.slots import SlotTable


class Seq2SeqRunner(OneByOnePrefill):
    """Encodes each request once at admission; decodes all rows together.

    A row holds the request's decoder self-attention K/V (right-aligned, as for decoder-only models)
    and its cross-attention K/V (left-aligned, masked by the encoder attention mask). Both are freed
    when the row is released.
    """

    logits_processors: Sequence[LogitsProcessor] = ()

    def __init__(self, model: PreTrainedModel, max_rows: int, max_model_len: int, max_input_len: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.max_input_len = max_input_len
        self.device = model.device
        decoder_config = model.config.get_text_config(decoder=True)
        layers = getattr(decoder_config, "num_decoder_layers", None) or decoder_config.num_hidden_layers
        self._start_token = _decoder_start_token(model)
        self._hidden_size = model.config.d_model if hasattr(model.config, "d_model") else model.config.hidden_size
        self._self_cache = BatchKVCache(layers, max_rows, max_model_len)
        self._cross_cache = CrossKVCache(layers, max_rows)
        self._slots = SlotTable(max_rows)

    def output_limit(self, prompt_len: int) -> int:
        return self.max_model_len

    def prefill_overhead(self, job: PrefillJob) -> int:
        return len(job.encoder_inputs.get("input_ids", ()))  # the encoder pass over the input

    @torch.inference_mode()
    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        # The encoder is bidirectional: it takes the whole input at once, whatever the budget.
        job.done = len(job.prompt_token_ids)
        own_cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        logits = self._prefill_forward(job, own_cache)
        return self._join(own_cache), logits

    def _prefill_forward(self, job: PrefillJob, own_cache: EncoderDecoderCache) -> torch.Tensor:
        """Encodes the request and runs the decoder's first step(s) into `own_cache`; returns next-token logits.

        The decoder starts from its start token, then the request's decoder prompt, if any.
        """
        input_ids = torch.tensor([list(job.encoder_inputs["input_ids"])], device=self.device)
        encoder_outputs = self.model.get_encoder()(input_ids=input_ids)
        out = self.model(
            encoder_outputs=encoder_outputs,
            decoder_input_ids=torch.tensor([[self._start_token, *job.prompt_token_ids]], device=self.device),
            past_key_values=own_cache,
            use_cache=True,
        )
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def _join(self, own_cache: EncoderDecoderCache) -> int:
        """Moves a prefilled request's self- and cross-attention K/V into a new row; returns its slot."""
        pos = self._self_cache.insert(layer_tensors(own_cache.self_attention_cache))
        try:
            if self._cross_cache.insert(layer_tensors(own_cache.cross_attention_cache)) != pos:
                raise RuntimeError("self- and cross-attention rows out of step")
        except Exception:
            self._self_cache.remove(pos)  # the row's two halves join together or not at all
            raise
        return self._slots.add(pos)

    @torch.inference_mode()
    def decode(self, last_tokens: Mapping[int, int]) -> tuple[list[int], torch.Tensor]:
        order = self._slots.order()
        logits = self._step(order, last_tokens)
        self._self_cache.advance(1)
        return order, logits

    @torch.inference_mode()
    def probe(self, last_tokens: Mapping[int, int]) -> None:
        order = [slot for slot in self._slots.order() if slot in last_tokens]
        positions = [self._slots.pos(slot) for slot in order]
        with self._self_cache.selecting(positions), self._cross_cache.selecting(positions):
            self._step(order, last_tokens)

    def _step(self, order: list[int], last_tokens: Mapping[int, int]) -> torch.Tensor:
        self_cache, cross_cache = self._self_cache, self._cross_cache
        self_cache.ensure_room(1)
        rows = len(order)
        cache = EncoderDecoderCache(self_cache, cross_cache)
        cache.is_updated = dict.fromkeys(range(len(cross_cache.layers)), True)  # cross K/V are cached already
        # The decoder reads only the shape of the encoder states (for its mask): the K/V come from the cache.
        shape_only = torch.zeros((), dtype=self.model.dtype, device=self.device).expand(
            rows, cross_cache.width, self._hidden_size
        )
        out = self.model(
            encoder_outputs=(shape_only,),
            decoder_input_ids=torch.tensor([[last_tokens[slot]] for slot in order], device=self.device),
            decoder_attention_mask=self_cache.attention_mask(extra=1),
            past_key_values=cache,
            use_cache=True,
            **self._step_inputs(),
        )
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    def _step_inputs(self) -> dict[str, torch.Tensor]:
        """What the model kind's decode step needs beside the tokens and caches: T5 masks padded encoder columns."""
        return {"attention_mask": self._cross_cache.encoder_mask()}

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        pos = self._slots.pos(slot)
        moved = self._self_cache.remove(pos)
        self._cross_cache.remove(pos)
        self._slots.remove(slot, moved)

    def rows_in_use(self) -> int:
        return len(self._slots)


def _decoder_start_token(model: PreTrainedModel) -> int:
    for source in (model.generation_config, model.config):
        token = getattr(source, "decoder_start_token_id", None)
        if token is not None:
            return int(token)
    raise ValueError("the model's config names no decoder_start_token_id")
