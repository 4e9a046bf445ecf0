"""Runner for encoder-decoder text models such as T5 (AutoModelForSeq2SeqLM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from transformers_openai.runners.base import (
    DecodeRows,
    KVPoolSpec,
    LogitsProcessor,
    OneByOnePrefill,
    PrefillJob,
    PrefillResult,
)
from transformers_openai.runners.kv.cross_cache import CrossKVCache
from transformers_openai.runners.kv.kv_cache import cache_keyword, layer_tensors
from transformers_openai.runners.kv.kv_pool import KVPool, KVSpace, self_attention_geometry
from transformers_openai.runners.kv.paged_cache import StepPlan
from transformers_openai.runners.slots import SlotTable


class Seq2SeqRunner(OneByOnePrefill):
    """Encodes each request once at admission; decodes all rows together.

    A row holds the request's decoder self-attention K/V (in the paged pool, as for decoder-only models; never
    shared, as they depend on the input) and its cross-attention K/V (per row, left-aligned, masked by the encoder
    attention mask; `max_rows` rows of the longest input are set aside from the K/V budget for them). Both are
    freed when the row is released.
    """

    logits_processors: Sequence[LogitsProcessor] = ()

    def __init__(
        self,
        model: PreTrainedModel,
        max_rows: int,
        max_model_len: int,
        max_input_len: int,
        kv: KVSpace | None = None,
    ) -> None:
        self.model = model
        self.max_rows = max_rows
        self.max_input_len = max_input_len
        self.device = model.device
        geometry = self_attention_geometry(model)
        self._start_token = _decoder_start_token(model)
        self._hidden_size = model.config.d_model if hasattr(model.config, "d_model") else model.config.hidden_size
        cross_bytes = max_rows * max_input_len * geometry.bytes_per_token
        self._pool = KVPool(model, max_rows, max_model_len + 1, kv, cross_bytes, shared_prefixes=False)
        self.kv_pool: KVPoolSpec = self._pool.spec
        self.max_model_len = min(max_model_len, self.kv_pool.token_capacity - 2)
        self._cross_cache = CrossKVCache(geometry.layers, max_rows, max_input_len)
        self._slots = SlotTable(max_rows)
        self._cache_keyword = cache_keyword(model)

    def output_limit(self, prompt_len: int) -> int:
        return self.max_model_len

    def prefill_overhead(self, job: PrefillJob) -> int:
        return len(job.encoder_inputs.get("input_ids", ()))  # the encoder pass over the input

    def decoder_prompt(self, job: PrefillJob) -> list[int]:
        """What the decoder reads before its first sampled token: its start token, then the request's prompt."""
        return [self._start_token, *job.prompt_token_ids]

    @torch.inference_mode()
    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        # The encoder is bidirectional: it takes the whole input at once, whatever the budget.
        job.done = len(job.prompt_token_ids)
        own_cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        logits = self._prefill_forward(job, own_cache)
        return self._join(job, own_cache), logits

    def _prefill_forward(self, job: PrefillJob, own_cache: EncoderDecoderCache) -> torch.Tensor:
        """Encodes the request and runs the decoder's first step(s) into `own_cache`; returns next-token logits.

        The decoder starts from its start token, then the request's decoder prompt, if any.
        """
        input_ids = torch.tensor([list(job.encoder_inputs["input_ids"])], device=self.device)
        encoder_outputs = self.model.get_encoder()(input_ids=input_ids)
        out = self.model(
            encoder_outputs=encoder_outputs,
            decoder_input_ids=torch.tensor([self.decoder_prompt(job)], device=self.device),
            use_cache=True,
            **{self._cache_keyword: own_cache},
        )
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def _join(self, job: PrefillJob, own_cache: EncoderDecoderCache) -> int:
        """Moves a prefilled request's self- and cross-attention K/V into a new row; returns its slot."""
        self_layers = layer_tensors(own_cache.self_attention_cache)
        self._pool.cache.copy_in(job.table, self_layers, start=0)
        pos = self._cross_cache.insert(layer_tensors(own_cache.cross_attention_cache))
        return self._slots.add(pos)

    @torch.inference_mode()
    def decode(self, rows: DecodeRows) -> tuple[list[int], torch.Tensor]:
        order = self._slots.order()
        return order, self._step(order, rows)

    @torch.inference_mode()
    def probe(self, rows: DecodeRows) -> None:
        # The step writes the rows' next slots, which nothing records: the next real step overwrites them.
        order = [slot for slot in self._slots.order() if slot in rows]
        with self._cross_cache.selecting([self._slots.pos(slot) for slot in order]):
            self._step(order, rows)

    def _step(self, order: list[int], rows: DecodeRows) -> torch.Tensor:
        self_cache, cross_cache = self._pool.cache, self._cross_cache
        plan = self_cache.plan([(rows[slot][0], 1) for slot in order])
        cache = EncoderDecoderCache(self_cache, cross_cache)
        cache.is_updated = dict.fromkeys(range(len(cross_cache.layers)), True)  # cross K/V are cached already
        # The decoder reads only the shape of the encoder states (for its mask): the K/V come from the cache.
        shape_only = torch.zeros((), dtype=self.model.dtype, device=self.device).expand(
            len(order), cross_cache.width, self._hidden_size
        )
        with self_cache.running(plan):
            out = self.model(
                encoder_outputs=(shape_only,),
                decoder_input_ids=torch.tensor([[rows[slot][1]] for slot in order], device=self.device),
                decoder_attention_mask=plan.mask,
                use_cache=True,
                **{self._cache_keyword: cache},
                **self._step_inputs(plan),
            )
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    def _step_inputs(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """What the model kind's decode step needs beside the tokens and caches: T5 masks padded encoder columns."""
        return {"attention_mask": self._cross_cache.encoder_mask()}

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        pos = self._slots.pos(slot)
        moved = self._cross_cache.remove(pos)
        self._slots.remove(slot, moved)

    def rows_in_use(self) -> int:
        return len(self._slots)


def _decoder_start_token(model: PreTrainedModel) -> int:
    for source in (model.generation_config, model.config):
        token = getattr(source, "decoder_start_token_id", None)
        if token is not None:
            return int(token)
    raise ValueError("the model's config names no decoder_start_token_id")
