"""Runs an encoder (BERT family) or a decoder's base model over a batch of inputs and pools one vector each."""

from __future__ import annotations

from typing import Any

import torch

from transformers_openai.runners.pooling import PoolingSpec, pool


class EmbeddingRunner:
    """Holds the base model (no head) and its pooling; embeds batches of token-id lists, one forward each.

    Rows are padded on the right: a decoder's last real token then sees exactly its own prefix, and an encoder's
    attention mask hides the padding, so a vector does not depend on what it was batched with (up to rounding).
    """

    def __init__(self, model: Any, spec: PoolingSpec, pad_token_id: int = 0) -> None:
        self.model = model
        self.spec = spec
        self.pad_token_id = pad_token_id
        self.device: torch.device = model.device
        self.width = int(model.config.get_text_config().hidden_size)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """float32 vectors [len(inputs), width], on the CPU, in the order of `inputs` (none may be empty)."""
        longest = max(len(ids) for ids in inputs)
        input_ids = torch.full((len(inputs), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, ids in enumerate(inputs):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        vectors = pool(hidden.float(), mask, self.spec.mode)
        if self.spec.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
        return vectors.cpu()
