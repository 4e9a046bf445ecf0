"""Runner for encoder-decoder text models such as T5 (AutoModelForSeq2SeqLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from transformers_openai.runners.base import (
    Acceleration,
    DecodeRow,
    LogitsProcessor,
    PrefillOutput,
    PrefillRow,
    Prepared,
    RunnerSpec,
    Step,
    StepOutput,
)
from transformers_openai.runners.kv.cross_cache import CrossKVCache
from transformers_openai.runners.kv.kv_cache import cache_keyword, layer_tensors
from transformers_openai.runners.kv.kv_pool import KVPool, KVSpace, self_attention_geometry
from transformers_openai.runners.kv.paged_cache import StepPlan
from transformers_openai.runners.lora.layers import LoraRows, LoraWeightsLike, rows_using, wrap_linear_layers
from transformers_openai.runners.packed_linear import unfuse_activations
from transformers_openai.runners.slots import SlotTable


class Seq2SeqRunner:
    """Encodes each request once at admission; decodes all rows together.

    A row holds the request's decoder self-attention K/V (in the paged pool, as for decoder-only models; never
    shared, as they depend on the input) and its cross-attention K/V (per row, left-aligned, masked by the encoder
    attention mask; `max_rows` rows of the longest input are set aside from the K/V budget for them). Both are
    freed when the row is released. The encoder reads its input whole: the prompt goes in in one step.

    With LoRA adapters (`serve_adapters`), every forward applies each row's own: its encoder pass, its prompt's
    decoder pass (which computes its cross-attention K/V), and its decode steps.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_rows: int,
        max_model_len: int,
        max_input_len: int,
        kv: KVSpace | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> None:
        self.model = model
        self.max_input_len = max_input_len
        self.device = model.device
        geometry = self_attention_geometry(model)
        self._hidden_size = model.config.d_model if hasattr(model.config, "d_model") else model.config.hidden_size
        cross_bytes = max_rows * max_input_len * geometry.bytes_per_token
        self._pool = KVPool(model, max_rows, max_model_len + 1, kv, cross_bytes, shared_prefixes=False)
        pool = self._pool.spec
        self.spec = RunnerSpec(
            max_rows,
            min(max_model_len, pool.token_capacity - 2),
            pool,
            logits_processors,
            decoder_start=self._decoder_start(model),
            whole_prompt=True,
        )
        self._cross_cache = CrossKVCache(geometry.layers, max_rows, max_input_len)
        self._slots = SlotTable()
        self._cache_keyword = cache_keyword(model)
        self.lora: LoraRows | None = None  # rows' LoRA adapters (`serve_adapters`)

    @staticmethod
    def _decoder_start(model: PreTrainedModel) -> int | None:
        """The token the decoder reads before the request's prompt: T5's start token."""
        return _decoder_start_token(model)

    def serve_adapters(self) -> dict[str, tuple[int, int]]:
        """From now on each row may run with its own LoRA adapter (`PrefillRow.lora`, `DecodeRow.lora`): the linear
        layers of the encoder's and decoder's blocks are wrapped to add each adapter's update to its rows. Returns
        the layers an adapter may target, (in, out) features by name (PEFT's names behind `base_model.model.`).
        Activations fused into packed layers come out again: an update to `fc1` is added before its GELU."""
        unfuse_activations(self.model)
        self.lora, shapes = wrap_linear_layers(self.model)
        return shapes

    def _adapters(self, adapters: Sequence[LoraWeightsLike | None]) -> AbstractContextManager[None]:
        """The forwards run inside apply `adapters[i]` to row `i` of their batch."""
        return rows_using(self.lora, adapters, self.device)

    def prepare(self, acceleration: Acceleration) -> Prepared:
        return Prepared()  # its steps run eagerly

    def prefill_cost(self, encoder_inputs: Mapping[str, Any]) -> int:
        return len(encoder_inputs.get("input_ids", ()))  # the encoder pass over the input

    @torch.inference_mode()
    def execute(self, step: Step) -> StepOutput:
        if step.probe:  # writes the rows' next slots, which nothing records: the next real step overwrites them
            rows = {row.slot: row for row in step.decodes}
            order = [slot for slot in self._slots.order() if slot in rows]
            with self._cross_cache.selecting([self._slots.pos(slot) for slot in order]):
                self._step(order, rows)
            return StepOutput()
        prefills = self._prefill(step.prefills)
        if not step.decodes:
            return StepOutput(prefills)
        order = self._slots.order()
        return StepOutput(prefills, order, self._step(order, {row.slot: row for row in step.decodes}))

    def _prefill(self, rows: Sequence[PrefillRow]) -> list[PrefillOutput | Exception]:
        """Each row alone (a row that fails gets its exception, the others go on)."""
        outcomes: list[PrefillOutput | Exception] = []
        for row in rows:
            try:
                outcomes.append(self._prefill_row(row))
            except Exception as exc:  # that row's failure only
                outcomes.append(exc)
        return outcomes

    def _prefill_row(self, row: PrefillRow) -> PrefillOutput:
        own_cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        info: dict[str, float] = {}
        with self._adapters([row.lora]):
            logits = self._prefill_forward(row, own_cache, info)
        self._join(row, own_cache)
        return PrefillOutput(logits[None], info)

    def _prefill_forward(self, row: PrefillRow, own_cache: EncoderDecoderCache, info: dict[str, float]) -> torch.Tensor:
        """Encodes the request and runs the decoder over its prompt (the start token first) into `own_cache`;
        returns next-token logits."""
        input_ids = torch.tensor([list(row.encoder_inputs["input_ids"])], device=self.device)
        encoder_outputs = self.model.get_encoder()(input_ids=input_ids)
        out = self.model(
            encoder_outputs=encoder_outputs,
            decoder_input_ids=torch.tensor([list(row.tokens)], device=self.device),
            use_cache=True,
            **{self._cache_keyword: own_cache},
        )
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits

    def _join(self, row: PrefillRow, own_cache: EncoderDecoderCache) -> None:
        """Moves a prefilled request's self- and cross-attention K/V into its row."""
        if row.slot in self._slots:
            raise RuntimeError(f"slot {row.slot} holds a row already")
        self_layers = layer_tensors(own_cache.self_attention_cache)
        self._pool.cache.copy_in(row.table, self_layers, start=0)
        pos = self._cross_cache.insert(layer_tensors(own_cache.cross_attention_cache))
        self._slots.add(row.slot, pos)

    def _step(self, order: list[int], rows: Mapping[int, DecodeRow]) -> torch.Tensor:
        self_cache, cross_cache = self._pool.cache, self._cross_cache
        plan = self_cache.plan([(rows[slot].table, 1) for slot in order])
        cache = EncoderDecoderCache(self_cache, cross_cache)
        cache.is_updated = dict.fromkeys(range(len(cross_cache.layers)), True)  # cross K/V are cached already
        # The decoder reads only the shape of the encoder states (for its mask): the K/V come from the cache.
        shape_only = torch.zeros((), dtype=self.model.dtype, device=self.device).expand(
            len(order), cross_cache.width, self._hidden_size
        )
        with self_cache.running(plan), self._adapters([rows[slot].lora for slot in order]):
            out = self.model(
                encoder_outputs=(shape_only,),
                decoder_input_ids=torch.tensor([[rows[slot].token] for slot in order], device=self.device),
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
        if slot not in self._slots:  # it never got its row (its prefill failed, or it left before)
            return
        moved = self._cross_cache.remove(self._slots.pos(slot))
        self._slots.remove(slot, moved)


def _decoder_start_token(model: PreTrainedModel) -> int:
    for source in (model.generation_config, model.config):
        token = getattr(source, "decoder_start_token_id", None)
        if token is not None:
            return int(token)
    raise ValueError("the model's config names no decoder_start_token_id")
