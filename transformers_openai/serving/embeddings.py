"""/v1/embeddings: inputs checked and tokenized here, embedded by the embedding engine, answered as floats or base64.

A request holds at most `max_total_tokens` tokens over all its inputs. Token ids are counted before anything else;
texts of more characters than that many tokens of the vocabulary could stand for are refused before any tokenizing,
and the others are tokenized in chunks, counted as they come, so a request over the bound stops at the chunk that
passes it.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np

from transformers_openai.protocol.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from transformers_openai.serving.context import EmbeddingModel, ServingContext
from transformers_openai.serving.disconnect import WaitDisconnect, until_disconnect
from transformers_openai.serving.errors import BadRequestError

# Characters of text tokenized at once (one task of the tokenizer's pool): about 15,000 tokens of English.
TOKENIZE_CHUNK_CHARS = 64 * 1024


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
        # Tokenizing is watched too: a client that leaves stops it at the next chunk.
        token_lists, vectors = await until_disconnect(
            self._embed(request), wait_disconnect, request_id or uuid.uuid4().hex
        )
        data = [
            Embedding(index=i, embedding=_encode(self._cut(vector, request.dimensions), request.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in token_lists)
        return EmbeddingResponse(
            data=data, model=request.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        )

    async def _embed(self, request: EmbeddingRequest) -> tuple[list[list[int]], list[np.ndarray]]:
        token_lists = await self._tokenize(request)
        return token_lists, await self.model.engine.embed(token_lists, request.priority)

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
        """Each input as token ids, checked against the vocabulary, the model's length and the request's budget."""
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
            self._check_chars(texts, keep)
            return await self._encode(texts, keep)
        id_lists = [ids for ids in inputs if isinstance(ids, list)]
        self._check_total(sum(min(len(ids), keep or len(ids)) for ids in id_lists))
        token_lists = [ids[:keep] if keep else list(ids) for ids in id_lists]
        self._check_ids(token_lists)
        self._check_lengths(token_lists, 0, len(token_lists))
        return token_lists

    async def _encode(self, texts: list[str], keep: int | None) -> list[list[int]]:
        """The texts tokenized a chunk at a time, each chunk checked before the next is tokenized."""
        token_lists: list[list[int]] = []
        total = 0
        for start, stop in _chunks(texts, TOKENIZE_CHUNK_CHARS):
            chunk = await self.ctx.tokenizer.encode_texts(texts[start:stop], max_length=keep)
            self._check_lengths(chunk, start, len(texts))
            total += sum(len(ids) for ids in chunk)
            self._check_total(total, stop if stop < len(texts) else None)
            token_lists += chunk
        return token_lists

    def _check_lengths(self, token_lists: list[list[int]], first: int, count: int) -> None:
        """Inputs `first`, `first + 1`, ... of `count` are neither empty nor longer than the model takes."""
        limit = self.model.max_input_len
        for i, ids in enumerate(token_lists, start=first):
            if not ids:
                raise BadRequestError(_where(i, count) + " has no tokens", param="input")
            if len(ids) > limit:
                raise BadRequestError(
                    f"{_where(i, count)} has {len(ids)} tokens, more than this model's {limit}; shorten "
                    "it or set truncate_prompt_tokens",
                    param="input",
                    code="context_length_exceeded",
                )

    def _check_total(self, tokens: int, counted_to: int | None = None) -> None:
        """`tokens` is within the request's budget; `counted_to`: the inputs after that one were not counted yet."""
        budget = self.model.max_total_tokens
        if tokens <= budget:
            return
        counted = f"the inputs before input {counted_to} have" if counted_to is not None else "the inputs have"
        raise BadRequestError(
            f"{counted} {tokens} tokens together; this server embeds at most {budget} tokens per request "
            "(--max-embedding-tokens): send fewer or shorter inputs, or set truncate_prompt_tokens",
            param="input",
            code="max_tokens_per_request",
        )

    def _check_chars(self, texts: list[str], keep: int | None) -> None:
        """Refuses texts that have more characters than the tokens allowed could stand for, before tokenizing: no
        token of the vocabulary stands for more than `max_token_chars` characters (a text the tokenizer shrinks
        more, e.g. one mostly of spaces, is refused too: the bound is stated in characters)."""
        limits = self.ctx.prompt_limits
        if limits is None:
            return
        per_token = max(1, limits.max_token_chars)
        if keep is None:
            most = self.model.max_input_len * per_token
            for i, text in enumerate(texts):
                if len(text) > most:
                    raise BadRequestError(
                        f"{_where(i, len(texts))} has {len(text)} characters; an input may have at most {most} "
                        f"(this model's {self.model.max_input_len} tokens times {per_token} characters, its longest "
                        "token); shorten it or set truncate_prompt_tokens",
                        param="input",
                        code="context_length_exceeded",
                    )
        # With truncate_prompt_tokens, the characters past what an input's kept tokens could stand for do not count.
        clip = keep * per_token if keep is not None else None
        chars = sum(min(len(text), clip or len(text)) for text in texts)
        budget = self.model.max_total_tokens
        if chars > budget * per_token:
            raise BadRequestError(
                f"the inputs have {chars} characters together; a request may have at most {budget * per_token} "
                f"({budget} tokens, --max-embedding-tokens, times {per_token} characters, this model's longest "
                "token): send fewer or shorter inputs",
                param="input",
                code="max_tokens_per_request",
            )

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


def _chunks(texts: list[str], max_chars: int) -> list[tuple[int, int]]:
    """`(start, stop)` ranges of `texts` of about `max_chars` characters each (a longer text is a range of its own)."""
    ranges: list[tuple[int, int]] = []
    start = chars = 0
    for i, text in enumerate(texts):
        if i > start and chars + len(text) > max_chars:
            ranges.append((start, i))
            start, chars = i, 0
        chars += len(text)
    ranges.append((start, len(texts)))
    return ranges


def _where(index: int, count: int) -> str:
    return "the input" if count == 1 else f"input {index}"


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """base64 is the vector's little-endian float32 bytes, as OpenAI's clients decode it."""
    floats = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(floats.tobytes()).decode("ascii")
    values: list[float] = floats.tolist()
    return values
