"""Runner for vision-language models (AutoModelForImageTextToText): a decoder whose prompt carries image features.

Decode rows, and prefill chunks without image tokens, run exactly as a decoder-only model's (`CausalLMRunner`): the
language model reads token ids. A prefill chunk with image tokens runs from input embeddings: the model's own token
embeddings with its own image features (`get_image_features`) written at the image token's places, as its forward
merges them, over the same paged K/V pool. Chunked prefill and a cached prefix may cut the prompt inside an image's
tokens, so a request's image features are computed once, kept for its row until its prompt is in, and each chunk takes
the ones its image tokens stand for. A model with multimodal positions (M-RoPE: `mrope.py`) runs every chunk and decode
step of a request with images at those positions.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from transformers_openai.runners.base import (
    Acceleration,
    DecodeRow,
    DecodeStep,
    PrefillOutput,
    PrefillRow,
    Prepared,
    Step,
    StepOutput,
)
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.kv_pool import KVSpace
from transformers_openai.runners.mrope import MROPE_TYPES, MultimodalPositions, rope_index
from transformers_openai.runners.prefill_groups import length_groups
from transformers_openai.runners.steps.paged_step import PagedStep

logger = logging.getLogger(__name__)

# What a request's encoder inputs carry beside the processor's tensors (the serving side adds them).
IMAGE_DIGEST, IMAGE_COUNT = "image_digest", "images"
# Processor outputs that describe the prompt's tokens, not its images.
TOKEN_TENSORS = frozenset({"mm_token_type_ids"})


def image_tensors(encoder_inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The processor's image tensors of a request (`pixel_values`, `image_sizes`, ...); empty without images."""
    if not encoder_inputs.get(IMAGE_COUNT):
        return {}
    return {
        key: value
        for key, value in encoder_inputs.items()
        if isinstance(value, torch.Tensor) and key not in TOKEN_TENSORS
    }


def image_problem(model: PreTrainedModel) -> str | None:
    """Why the runner cannot place this model's images in its prompt; None when it can."""
    name = type(model).__name__
    if rope_index(model) is not None and model.config.model_type not in MROPE_TYPES:
        return (
            f"{name} places image tokens with multimodal position ids of its own, which this server does not compute "
            f"yet (of the models with M-RoPE, {', '.join(sorted(MROPE_TYPES))} are served)"
        )
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        return f"{name} attends to its image tokens with a mask of its own (token_type_ids), which is not served yet"
    if getattr(model, "get_image_features", None) is None:
        return f"{name} has no get_image_features: its images cannot be merged into the prompt"
    return None


class VisionLMRunner(CausalLMRunner):
    """A `CausalLMRunner` whose prefill chunks with image tokens run from embeddings (see the module's docstring).

    Image encoding is batched across the rows of a step whose image tensors stack (same shapes beyond the first
    dimension); features are kept per slot until the prompt's last chunk or `release`.
    """

    def __init__(self, model: PreTrainedModel, max_rows: int, max_model_len: int, kv: KVSpace | None = None) -> None:
        super().__init__(model, max_rows, max_model_len, kv)
        image_token = getattr(model.config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(model.config, "image_token_index", None)
        if image_token is None:
            raise ValueError(f"{type(model).__name__}'s config names no image token (image_token_id)")
        self.image_token = int(image_token)
        if not isinstance(self.executor, PagedStep):
            raise TypeError("a vision-language model runs on this process's own paged step")
        self._paged: PagedStep = self.executor
        self._embed = model.get_input_embeddings()
        vision = getattr(model.config, "vision_config", None)
        self._patch = int(getattr(vision, "patch_size", 0) or 0)
        self._features: dict[int, torch.Tensor] = {}  # slot -> its request's image features `[features, hidden]`
        self._mrope = MultimodalPositions.of(model, self.image_token)

    def prepare(self, acceleration: Acceleration) -> Prepared:
        """As a decoder's (the fixed decode step runs the whole model's forward on token ids), but not under tensor
        parallelism, which the loader refuses."""
        if acceleration.distribute is not None:
            raise ValueError("tensor parallelism does not serve vision-language models")
        return super().prepare(acceleration)

    def fix_steps(
        self,
        graphs: bool,
        buckets: bool | None = None,
        compiled: bool = False,
        prefills: bool = True,
        store: Path | None = None,
    ) -> bool:
        """As a decoder's, except for a model with multimodal positions: its decode steps place each row at its own
        offset, which the fixed steps do not take (they run eagerly)."""
        if self._mrope is not None:
            logger.info("multimodal positions (M-RoPE): steps run eagerly")
            return False
        return super().fix_steps(graphs, buckets, compiled, prefills, store)

    def compile_in_background(
        self,
        store: Path,
        compile_elsewhere: Callable[[], None],
        on_compiled: Callable[[DecodeStep], None] | None = None,
    ) -> bool:
        """As a decoder's, except for a model with multimodal positions (as `fix_steps`)."""
        if self._mrope is not None:
            logger.info("multimodal positions (M-RoPE): steps run eagerly")
            return False
        return super().compile_in_background(store, compile_elsewhere, on_compiled)

    def prefill_cost(self, encoder_inputs: Mapping[str, Any]) -> int:
        """The vision tower's work in prompt-token units: one per patch of every image tile it reads."""
        pixels = image_tensors(encoder_inputs).get("pixel_values")
        if pixels is not None and pixels.dim() == 2:  # already cut into patches, one a row (Qwen2-VL)
            return int(pixels.shape[0])
        if pixels is None or pixels.dim() < 3 or not self._patch:
            return 0
        channels = int(pixels.shape[-3])
        return int(pixels.numel() // (channels * self._patch * self._patch))

    @torch.inference_mode()
    def execute(self, step: Step) -> StepOutput:
        rows = step.prefills
        merged = [i for i, row in enumerate(rows) if self._needs_features(row)]
        if step.probe or not merged:
            out = super().execute(step)
            self._forget_done(rows)
            return out
        outcomes: list[PrefillOutput | Exception | None] = [None] * len(rows)
        plain = sorted(set(range(len(rows))) - set(merged))
        if plain:
            for i, outcome in zip(plain, self._prefill([rows[i] for i in plain]), strict=True):
                outcomes[i] = outcome
        for i, outcome in zip(merged, self._prefill_merged([rows[i] for i in merged]), strict=True):
            outcomes[i] = outcome
        prefills = [outcome if outcome is not None else RuntimeError("row not run") for outcome in outcomes]
        self._forget_done(rows)
        if not step.decodes:
            return StepOutput(prefills)
        slots, logits = self._decode(step.decodes)
        return StepOutput(prefills, slots, logits)

    def _forget_done(self, rows: Sequence[PrefillRow]) -> None:
        """A prompt all in needs its image features (and prompt positions) no more."""
        for row in rows:
            if row.last:
                self._features.pop(row.slot, None)
                if self._mrope is not None:
                    self._mrope.prompt_done(row.slot)

    def _needs_features(self, row: PrefillRow) -> bool:
        """Whether this chunk runs from embeddings: it holds image tokens of a request with images, or, with
        multimodal positions, it is any chunk of such a request (a chunk of text only otherwise runs as text)."""
        if not row.encoder_inputs.get(IMAGE_COUNT):
            return False
        return self._mrope is not None or self.image_token in row.tokens

    def _decode(self, rows: Sequence[DecodeRow]) -> tuple[list[int], torch.Tensor]:
        positions = self._mrope.decode(rows) if self._mrope is not None else None
        if positions is None:
            return super()._decode(rows)
        logits = self._paged.forward([(row.table, [row.token]) for row in rows], 1, positions)
        return [row.slot for row in rows], logits[:, -1].float()

    def _prefill_merged(self, rows: Sequence[PrefillRow]) -> list[PrefillOutput | Exception]:
        """Chunks with image tokens: their requests' features (encoded together where they stack), then their
        embeddings in forwards of similar lengths (a scored chunk alone). A row that fails alone gets its exception."""
        outcomes: list[PrefillOutput | Exception | None] = [None] * len(rows)
        embeds: dict[int, torch.Tensor] = {}
        for i, failure in self._encode(rows).items():
            outcomes[i] = failure
        for i, row in enumerate(rows):
            if outcomes[i] is None:
                try:
                    embeds[i] = self._chunk_embeddings(row)
                except Exception as exc:  # that row's failure only
                    outcomes[i] = exc
        ready = [i for i in embeds if not rows[i].score]
        lengths = [len(rows[i].tokens) for i in ready]
        groups = [[ready[g] for g in group] for group in length_groups(lengths, self.max_padding)]
        groups += [[i] for i in embeds if rows[i].score]
        for group in groups:
            keep = 0 if rows[group[0]].score else 1
            try:
                positions = None
                if self._mrope is not None:
                    positions = self._mrope.prefill([rows[i] for i in group], max(len(embeds[i]) for i in group))
                logits = self._paged.forward_embeds([(rows[i].table, embeds[i]) for i in group], keep, positions)
            except Exception as exc:
                if len(group) == 1:
                    outcomes[group[0]] = exc
                else:  # one chunk may be at fault: each of them alone, failing alone
                    groups.extend([i] for i in group)
                continue
            for i, row_logits in zip(group, logits, strict=True):
                outcomes[i] = PrefillOutput(row_logits if rows[i].score or rows[i].last else None)
        return [outcome if outcome is not None else RuntimeError("row not run") for outcome in outcomes]

    def _encode(self, rows: Sequence[PrefillRow]) -> dict[int, Exception]:
        """Computes the image features of the rows' requests that have none kept yet, one vision pass for each set
        of requests whose image tensors stack; returns the rows that failed."""
        pending: dict[tuple[Any, ...], list[int]] = {}
        for i, row in enumerate(rows):
            if row.slot not in self._features and self.image_token in row.tokens:
                tensors = image_tensors(row.encoder_inputs)
                shape = tuple(sorted((key, tuple(value.shape[1:]), value.dtype) for key, value in tensors.items()))
                pending.setdefault(shape, []).append(i)
        failures: dict[int, Exception] = {}
        for members in pending.values():
            if len(members) > 1 and self._encode_together([rows[i] for i in members]):
                continue
            for i in members:
                try:
                    self._features[rows[i].slot] = self._image_features([image_tensors(rows[i].encoder_inputs)])
                except Exception as exc:  # that request's images only
                    failures[i] = exc
        return failures

    def _encode_together(self, rows: Sequence[PrefillRow]) -> bool:
        """One vision pass over the images of several requests, its features shared out by their image token
        counts; False when they cannot be (the caller encodes them one by one)."""
        wanted = [sum(1 for token in row.prompt if token == self.image_token) for row in rows]
        try:
            features = self._image_features([image_tensors(row.encoder_inputs) for row in rows])
        except Exception:
            logger.debug("images of %d requests not encoded together", len(rows), exc_info=True)
            return False
        if features.shape[0] != sum(wanted):
            return False
        for row, part in zip(rows, torch.split(features, wanted), strict=True):
            self._features[row.slot] = part
        return True

    def _image_features(self, requests: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """The model's own image features for the requests' images, in order, flattened to `[features, hidden]`."""
        dtype = self.model.dtype
        inputs = {
            key: torch.cat([tensors[key] for tensors in requests]).to(
                self.device, dtype=dtype if requests[0][key].is_floating_point() else None
            )
            for key in requests[0]
        }
        model: Any = self.model  # every image-text-to-text model has it (the loader checks), PreTrainedModel does not
        output = model.get_image_features(**inputs, return_dict=True)
        pooled = output.pooler_output if hasattr(output, "pooler_output") else output
        parts = pooled if isinstance(pooled, (list, tuple)) else [pooled]
        width = parts[0].shape[-1]
        return torch.cat([part.reshape(-1, width) for part in parts])

    def _chunk_embeddings(self, row: PrefillRow) -> torch.Tensor:
        """The chunk's input embeddings `[tokens, hidden]`: its tokens' own, the image tokens' replaced by the
        features they stand for (counted from the prompt's start; image tokens past the features, which only a
        generated token can be, keep their own embedding, as in the model's `generate`)."""
        tokens = torch.tensor(row.tokens, device=self.device)
        embeds: torch.Tensor = self._embed(tokens)
        features = self._features.get(row.slot)
        if features is None:  # a chunk of text (encoded otherwise: its image tokens made sure of that)
            return embeds
        start = row.table.length
        before = sum(1 for token in row.prompt[:start] if token == self.image_token)
        places = (tokens == self.image_token).nonzero()[:, 0]
        taken = features[before : before + len(places)]
        if start + len(row.tokens) == len(row.prompt) and before + len(places) < len(features):
            raise ValueError(
                f"the prompt has fewer image tokens ({before + len(places)}) than its images have features "
                f"({len(features)})"
            )
        embeds[places[: len(taken)]] = taken.to(embeds.dtype)
        return embeds

    def release(self, slot: int) -> None:
        self._features.pop(slot, None)
        if self._mrope is not None:
            self._mrope.release(slot)
        super().release(slot)
