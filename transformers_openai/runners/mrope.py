"""Multimodal rotary positions (Qwen2-VL's M-RoPE) for the rows of a vision-language model.

Such a model places a prompt's tokens on three axes (time, height, width): text advances all three by one, an
image's tokens take their grid's coordinates, and the text after an image resumes after its largest coordinate. A
row's prompt positions come from the model's own `get_rope_index`, once per request; its generated tokens then stand
at their place in the row plus the request's offset (`delta`: the prompt's last position + 1 - its length), as the
model's `generate` places them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from transformers_openai.runners.base import DecodeRow, PrefillRow

# The families whose `get_rope_index` reads a prompt's ids, its image grids and its token types alone; others (e.g.
# Qwen3-VL, which also feeds image features to inner layers) are refused by the loader.
MROPE_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})


def rope_index(model: PreTrainedModel) -> Callable[..., Any] | None:
    """The model's `get_rope_index`, if it places tokens with multimodal positions."""
    for module in (model, getattr(model, "model", None)):
        index: Callable[..., Any] | None = getattr(module, "get_rope_index", None)
        if callable(index):
            return index
    return None


class MultimodalPositions:
    """The M-RoPE positions of each row, kept by slot: a prompt's while it goes in, its offset until it leaves."""

    def __init__(self, index: Callable[..., Any], image_token: int, merge_size: int) -> None:
        self._index = index
        self._image_token = image_token
        self._merge = merge_size
        self._prompts: dict[int, torch.Tensor] = {}  # slot -> `[3, prompt]` positions of its prompt
        self._deltas: dict[int, int] = {}  # slot -> its generated tokens' offset

    @classmethod
    def of(cls, model: PreTrainedModel, image_token: int) -> MultimodalPositions | None:
        index = rope_index(model)
        if index is None:
            return None
        merge = int(getattr(model.config.vision_config, "spatial_merge_size", 1))
        return cls(index, image_token, merge)

    def prefill(self, rows: Sequence[PrefillRow], queries: int) -> torch.Tensor:
        """The positions `[3, rows, queries]` of the rows' chunks, right-aligned (padding at 0)."""
        positions = torch.zeros(3, len(rows), queries, dtype=torch.long)
        for i, row in enumerate(rows):
            prompt = self._prompt(row)
            start = row.table.length
            positions[:, i, queries - len(row.tokens) :] = prompt[:, start : start + len(row.tokens)]
        return positions

    def decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor | None:
        """The positions `[3, rows, 1]` of the rows' next tokens; None when no row has images (their own)."""
        if not any(row.slot in self._deltas for row in rows):
            return None
        places = torch.tensor([[row.table.length + self._deltas.get(row.slot, 0)] for row in rows])
        return places[None].expand(3, -1, -1)

    def _prompt(self, row: PrefillRow) -> torch.Tensor:
        """A request's prompt positions, computed on its first chunk (its prompt: after a preemption, with the
        tokens generated so far, which continue the text)."""
        known = self._prompts.get(row.slot)
        if known is not None:
            return known
        ids = torch.tensor([list(row.prompt)])
        grids = _grids(row.encoder_inputs)
        types = torch.zeros_like(ids, dtype=torch.int)
        if grids is not None:
            image_tokens = int((grids.prod(-1) // (self._merge * self._merge)).sum())
            places = (ids[0] == self._image_token).nonzero()[:image_tokens, 0]  # a generated one is text
            types[0, places] = 1
        positions, delta = self._index(ids, mm_token_type_ids=types, image_grid_thw=grids)
        prompt: torch.Tensor = positions[:, 0].cpu()
        self._prompts[row.slot] = prompt
        self._deltas[row.slot] = int(torch.as_tensor(delta).reshape(-1)[0])
        return prompt

    def prompt_done(self, slot: int) -> None:
        self._prompts.pop(slot, None)

    def release(self, slot: int) -> None:
        self._prompts.pop(slot, None)
        self._deltas.pop(slot, None)


def _grids(encoder_inputs: Mapping[str, Any]) -> torch.Tensor | None:
    grids = encoder_inputs.get("image_grid_thw")
    return grids if isinstance(grids, torch.Tensor) else None
