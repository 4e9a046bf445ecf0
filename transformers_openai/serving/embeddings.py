"""/v1/embeddings: inputs checked and tokenized here, embedded by the embedding engine, answered as floats or base64."""

from __future__ import annotations

import base64
import uuid

import numpy as np

from transformers_openai.protocol.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from transformers_openai.serving.context import EmbeddingModel, ServingContext
from transformers_openai.serving.disconnect import WaitDisconnect, until_disconnect
from transformers_openai.serving.errors import BadRequestError


class EmbeddingHandler:
    """Serves /v1/embeddings for an embedding model."""

    endpoint = "embeddings"

    def __init__(self, ctx: ServingContext) -> None:
        if ctx.embeddings is None:
            raise ValueError("an embeddings handler needs an embedding model")
        self.ctx = ctx
        self.model: EmbeddingModel = ctx.embeddings

    async def create(
        self, request: EmbeddingRequest, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> EmbeddingResponse:
        self.ctx.check_model(request.model)
        self._check_dimensions(request.dimensions)
        token_lists = await self._tokenize(request)
        vectors = await until_disconnect(
            self.model.engine.embed(token_lists), wait_disconnect, request_id or uuid.uuid4().hex
        )
        data = [
            Embedding(index=i, embedding=_encode(self._cut(vector, request.dimensions), request.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in token_lists)
        return EmbeddingResponse(
            data=data, model=request.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        )

    def _check_dimensions(self, dimensions: int | None) -> None:
        model = self.model
        if dimensions is None or dimensions == model.width:
            return
        if not model.matryoshka:
            raise BadRequestError(
                f"this model gives {model.width}-dimensional vectors and cannot be cut to {dimensions}: it was not "
                "trained for shorter ones (Matryoshka); leave 'dimensions' out",
                param="dimensions",
            )
        allowed = model.matryoshka_dims
        if dimensions > model.width or (allowed is not None and dimensions not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {model.width}"
            raise BadRequestError(f"dimensions must be one of this model's sizes: {sizes}", param="dimensions")

    async def _tokenize(self, request: EmbeddingRequest) -> list[list[int]]:
        """Each input as token ids, checked against the vocabulary and the model's length."""
        limit = self.model.max_input_len
        truncate = request.truncate_prompt_tokens
        keep = limit if truncate == -1 else truncate
        if keep is not None and keep > limit:
            raise BadRequestError(
                f"truncate_prompt_tokens {keep} is more than this model's {limit} input tokens",
                param="truncate_prompt_tokens",
            )
        inputs = request.inputs()
        if isinstance(inputs[0], str):
            texts = [text for text in inputs if isinstance(text, str)]
            for i, text in enumerate(texts):
                if not text:
                    raise BadRequestError(_where(i, len(texts)) + " is an empty string", param="input")
            token_lists = await self.ctx.tokenizer.encode_texts(texts, max_length=keep)
        else:
            token_lists = [list(ids)[:keep] if keep else list(ids) for ids in inputs if isinstance(ids, list)]
            self._check_ids(token_lists)
        for i, ids in enumerate(token_lists):
            if not ids:
                raise BadRequestError(_where(i, len(token_lists)) + " has no tokens", param="input")
            if len(ids) > limit:
                raise BadRequestError(
                    f"{_where(i, len(token_lists))} has {len(ids)} tokens, more than this model's {limit}; shorten "
                    "it or set truncate_prompt_tokens",
                    param="input",
                    code="context_length_exceeded",
                )
        return token_lists

    def _check_ids(self, token_lists: list[list[int]]) -> None:
        vocab = self.ctx.tokenizer.vocab_size
        for i, ids in enumerate(token_lists):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise BadRequestError(
                    f"{_where(i, len(token_lists))} has token id {bad}, outside the vocabulary (0 to {vocab - 1})",
                    param="input",
                )

    def _cut(self, vector: np.ndarray, dimensions: int | None) -> np.ndarray:
        if dimensions is None or dimensions >= vector.shape[0]:
            return vector
        cut = vector[:dimensions]
        if self.model.normalized:
            cut = cut / max(float(np.linalg.norm(cut)), 1e-12)
        return cut


def _where(index: int, count: int) -> str:
    return "the input" if count == 1 else f"input {index}"


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """base64 is the vector's little-endian float32 bytes, as OpenAI's clients decode it."""
    floats = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(floats.tobytes()).decode("ascii")
    values: list[float] = floats.tolist()
    return values
