"""Runner for decoder-only language models (AutoModelForCausalLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from transformers_openai.runners.base import LogitsProcessor, OneByOnePrefill, PrefillJob, PrefillResult
from transformers_openai.runners.kv_cache import BatchKVCache, layer_tensors
from transformers_openai.runners.slots import SlotTable

# A scored prompt is prefilled in chunks of at most this many tokens, so its full logits stay small.
SCORED_CHUNK_TOKENS = 512


class CausalLMRunner(OneByOnePrefill):
    """Prefills each request alone, then decodes all rows together over one `BatchKVCache`."""

    logits_processors: Sequence[LogitsProcessor] = ()

    def __init__(self, model: PreTrainedModel, max_rows: int, max_model_len: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.device = model.device
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._cache = BatchKVCache(layers, max_rows, max_model_len)
        self._slots = SlotTable(max_rows)

    def output_limit(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len

    def prefill_overhead(self, job: PrefillJob) -> int:
        return 0  # its tokens are the whole cost

    @torch.inference_mode()
    def prefill(self, job: PrefillJob, max_tokens: int) -> PrefillResult:
        # The request's own cache grows chunk by chunk; the row joins the batch when the prompt is in.
        if job.state is None:
            job.state = DynamicCache()
        scoring = job.prompt_logprobs is not None
        take = max(max_tokens, 1) if not scoring else min(max(max_tokens, 1), SCORED_CHUNK_TOKENS)
        end = min(len(job.prompt_token_ids), job.done + take)
        chunk = torch.tensor([job.prompt_token_ids[job.done : end]], device=self.device)
        keep = 0 if scoring else 1  # every position's logits when the prompt is scored
        out = self.model(input_ids=chunk, past_key_values=job.state, use_cache=True, logits_to_keep=keep)
        if scoring:
            _score(job, out.logits[0], end)
        job.done = end
        if job.remaining:
            return None
        pos = self._cache.insert(layer_tensors(job.state))
        job.state = None
        return self._slots.add(pos), out.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, last_tokens: Mapping[int, int]) -> tuple[list[int], torch.Tensor]:
        order = self._slots.order()
        logits = self._step(order, last_tokens)
        self._cache.advance(1)
        return order, logits

    @torch.inference_mode()
    def probe(self, last_tokens: Mapping[int, int]) -> None:
        order = [slot for slot in self._slots.order() if slot in last_tokens]
        with self._cache.selecting([self._slots.pos(slot) for slot in order]):
            self._step(order, last_tokens)

    def _step(self, order: list[int], last_tokens: Mapping[int, int]) -> torch.Tensor:
        cache = self._cache
        cache.ensure_room(1)
        input_ids = torch.tensor([[last_tokens[slot]] for slot in order], device=self.device)
        position_ids = torch.tensor([[n] for n in cache.active_lens], device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=cache.attention_mask(extra=1),
            past_key_values=cache,
            use_cache=True,
        )
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        moved = self._cache.remove(self._slots.pos(slot))
        self._slots.remove(slot, moved)

    def rows_in_use(self) -> int:
        return len(self._slots)


def _score(job: PrefillJob, logits: torch.Tensor, end: int) -> None:
    """Appends the logprobs of the prompt tokens this chunk predicts (positions done+1 .. end, within the prompt)."""
    targets = job.prompt_token_ids[job.done + 1 : end + 1]
    if not targets:
        return
    logprobs = logits[: len(targets)].float().log_softmax(dim=-1)
    picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
    chosen = picked[:, 0].tolist()
    ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()
    k = job.prompt_logprobs or 0
    if k:
        values, indices = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in targets]
    job.prompt_scores.extend(zip(chosen, ranks, tops, strict=True))
