"""Runs a cross-encoder (a sequence classifier with one label) over a batch of query-document pairs: a score each."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch

# What turns the classifier's logit into the score: sentence-transformers' CrossEncoder applies a sigmoid to a
# one-label model unless the model's config names another activation (Identity: the raw logit).
Activation = Literal["sigmoid", "identity", "tanh"]
_ACTIVATIONS = {"sigmoid": torch.sigmoid, "identity": lambda logits: logits, "tanh": torch.tanh}


class PairInput(Protocol):
    """A query and a document tokenized together (`engine.embedding_engine.TokenPair`)."""

    @property
    def ids(self) -> list[int]: ...

    @property
    def type_ids(self) -> list[int] | None: ...


class CrossEncoderRunner:
    """Holds the classifier; scores batches of pairs, one forward each.

    Rows are padded on the right with the attention mask hiding the padding: an encoder's first token (what its
    pooler and head read) and a decoder's last real token (what transformers' classifier reads, found by the padding
    id) see only their own pair, so a score does not depend on what it was batched with (up to rounding).
    """

    def __init__(self, model: Any, activation: Activation, pad_token_id: int) -> None:
        self.model = model
        self.activation: Activation = activation
        self.pad_token_id = pad_token_id
        self.device: torch.device = model.device
        self.takes_token_types = "token_type_ids" in inspect.signature(model.forward).parameters

    @torch.inference_mode()
    def embed(self, inputs: Sequence[PairInput]) -> torch.Tensor:
        """float32 scores [len(inputs), 1] on the CPU, in the order of `inputs` (the embedding engine's one call)."""
        longest = max(len(pair.ids) for pair in inputs)
        input_ids = torch.full((len(inputs), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        types = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, pair in enumerate(inputs):
            input_ids[row, : len(pair.ids)] = torch.tensor(pair.ids, dtype=torch.long)
            mask[row, : len(pair.ids)] = 1
            if pair.type_ids is not None:
                types[row, : len(pair.type_ids)] = torch.tensor(pair.type_ids, dtype=torch.long)
        batch = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.takes_token_types and any(pair.type_ids is not None for pair in inputs):
            batch["token_type_ids"] = types.to(self.device)
        logits: torch.Tensor = self.model(**batch).logits.float()
        scores: torch.Tensor = _ACTIVATIONS[self.activation](logits[:, :1])
        return scores.cpu()
