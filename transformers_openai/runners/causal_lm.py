"""Runner for decoder-only language models (AutoModelForCausalLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from transformers_openai.runners.base import LogitsProcessor, OneByOnePrefill, PrefillJob, PrefillResult
from transformers_openai.runners.kv_cache import BatchKVCache, layer_tensors
from transformers_openai.runners.prefill_groups import length_groups
from transformers_openai.runners.slots import SlotTable

# A scored prompt is prefilled in chunks of at most this many tokens, so its full logits stay small.
SCORED_CHUNK_TOKENS = 512
# Padding a batched prefill may add, as a share of its real tokens. On a CPU padding costs its arithmetic; on a
# GPU a forward costs mostly its launch overhead, so fewer, more padded forwards win.
CPU_MAX_PADDING = 0.25
GPU_MAX_PADDING = 1.0

Layers = list[tuple[torch.Tensor, torch.Tensor]]


class CausalLMRunner(OneByOnePrefill):
    """Prefills the prompts admitted in a step together, then decodes all rows together over one `BatchKVCache`.

    Prompts that fit whole in their step go through one left-padded forward per group of similar lengths
    (identical prompts are computed once and their rows copied); a prompt chunked over several steps, or one whose
    logprobs are scored, is prefilled alone.
    """

    logits_processors: Sequence[LogitsProcessor] = ()

    def __init__(self, model: PreTrainedModel, max_rows: int, max_model_len: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.device = model.device
        self.max_padding = CPU_MAX_PADDING if self.device.type == "cpu" else GPU_MAX_PADDING
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._cache = BatchKVCache(layers, max_rows, max_model_len)
        self._slots = SlotTable(max_rows)

    def output_limit(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len

    def prefill_overhead(self, job: PrefillJob) -> int:
        return 0  # its tokens are the whole cost

    @torch.inference_mode()
    def prefill_batch(self, jobs: Sequence[tuple[PrefillJob, int]]) -> list[PrefillResult | Exception]:
        outcomes: list[PrefillResult | Exception] = [None] * len(jobs)
        alone: list[int] = []
        same: dict[tuple[int, ...], list[int]] = {}  # each distinct whole prompt -> the jobs that have it
        for i, (job, take) in enumerate(jobs):
            whole = job.state is None and job.prompt_logprobs is None and 0 < job.remaining <= take
            if whole:
                same.setdefault(tuple(job.prompt_token_ids), []).append(i)
            else:
                alone.append(i)
        prompts = list(same)
        filled: list[tuple[tuple[int, ...], Layers, torch.Tensor]] = []
        for group in length_groups([len(p) for p in prompts], self.max_padding):
            members = [prompts[g] for g in group]
            try:
                filled.extend(zip(members, *self._prefill_together(members), strict=True))
            except Exception:  # one prompt may be at fault: each of them alone, failing alone
                alone.extend(i for prompt in members for i in same[prompt])
        # The longest first: a row longer than the batch shifts every row once, not once per newcomer.
        for prompt, layers, logits in sorted(filled, key=lambda f: -len(f[0])):
            for i in same[prompt]:
                try:
                    pos = self._cache.insert(layers)
                except Exception as exc:  # that job's failure only
                    outcomes[i] = exc
                    continue
                jobs[i][0].done = len(prompt)
                outcomes[i] = self._slots.add(pos), logits
        for i in alone:
            try:
                outcomes[i] = self.prefill(*jobs[i])
            except Exception as exc:  # that job's failure only
                outcomes[i] = exc
        return outcomes

    def _prefill_together(self, prompts: list[tuple[int, ...]]) -> tuple[list[Layers], list[torch.Tensor]]:
        """One left-padded forward over whole prompts; each prompt's own K/V (padding cut off) and last logits."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch = layer_tensors(cache)
        layers = [
            [(k[row : row + 1, :, width - len(p) :], v[row : row + 1, :, width - len(p) :]) for k, v in batch]
            for row, p in enumerate(prompts)
        ]
        logits = out.logits[:, -1].float()
        return layers, list(logits)

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
