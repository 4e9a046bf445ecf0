"""How text pairs get their scores: a cross-encoder reads each pair together and scores it in one forward (batched
with other requests' pairs on the embedding engine); an embedding model embeds each text once and scores a pair by
the cosine similarity of its two vectors, as vLLM scores with embedding models.

Texts are tokenized a chunk at a time, each chunk checked before the next is tokenized: a request past its bounds
stops at the chunk that passes them, and a client that leaves stops it at the next chunk.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from transformers_openai.engine.embedding_engine import TokenPair
from transformers_openai.serving.context import CrossEncoderModel, EmbeddingModel
from transformers_openai.serving.embeddings import TOKENIZE_CHUNK_CHARS
from transformers_openai.serving.scoring.limits import Describe, ScoreLimits
from transformers_openai.serving.tokenizer import TokenizerService

T = TypeVar("T", bound=Sized)  # a tokenized input: token ids, or a pair


@dataclass(frozen=True)
class Sides:
    """How a request names its two sides, for errors: rerank's `query` and `documents`, score's `text_1` and
    `text_2`; a side given as a list names its texts by index (`documents[3]`)."""

    first: str
    second: str
    first_listed: bool = False
    second_listed: bool = True

    def name(self, side: str, index: int) -> tuple[str, str]:
        """How a message names text `index` of `side`, and the request field it is in."""
        listed = self.first_listed if side == self.first else self.second_listed
        return (f"{side}[{index}]" if listed else side), side


@dataclass(frozen=True)
class Scored:
    scores: list[float]  # one per pair, in the pairs' order
    tokens: int  # the tokens the model read


class Scorer(Protocol):
    async def score(self, firsts: list[str], seconds: list[str], truncate: int | None, sides: Sides) -> Scored:
        """A score for each pair (`firsts[i]`, `seconds[i]`); a single first text is paired with every second."""
        ...


class CrossEncoderScorer:
    """Pairs tokenized together (query first, with the model's special tokens and token types) and scored by the
    cross-encoder: its one logit, through the activation its config names (a sigmoid by default)."""

    def __init__(self, tokenizer: TokenizerService, model: CrossEncoderModel, token_chars: int) -> None:
        self.tokenizer = tokenizer
        self.engine = model.engine
        self.limits = ScoreLimits(model.max_input_len, model.max_total_tokens, token_chars)

    async def score(self, firsts: list[str], seconds: list[str], truncate: int | None, sides: Sides) -> Scored:
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        keep = self.limits.keep(truncate)

        def describe(i: int) -> tuple[str, str]:
            name, param = sides.name(sides.second, i)
            return f"{name} with its {sides.first}", param

        chars = [len(a) + len(b) for a, b in zip(firsts, seconds, strict=True)]
        self.limits.check_chars(chars, keep, describe)

        async def encode(start: int, stop: int) -> list[TokenPair]:
            encoded = await self.tokenizer.encode_pairs(firsts[start:stop], seconds[start:stop], keep)
            return [TokenPair(ids, types) for ids, types in encoded]

        pairs = await _in_chunks(chars, encode, self.limits, keep, describe)
        vectors = await self.engine.embed(pairs)
        return Scored([float(vector[0]) for vector in vectors], sum(len(pair) for pair in pairs))


class CosineScorer:
    """Each text embedded once by the embedding model (a single first text is not repeated), a pair scored by the
    cosine similarity of its two vectors."""

    def __init__(self, tokenizer: TokenizerService, model: EmbeddingModel, token_chars: int) -> None:
        self.tokenizer = tokenizer
        self.engine = model.engine
        self.limits = ScoreLimits(model.max_input_len, model.max_total_tokens, token_chars)

    async def score(self, firsts: list[str], seconds: list[str], truncate: int | None, sides: Sides) -> Scored:
        keep = self.limits.keep(truncate)
        texts = firsts + seconds

        def describe(i: int) -> tuple[str, str]:
            if i < len(firsts):
                return sides.name(sides.first, i)
            return sides.name(sides.second, i - len(firsts))

        chars = [len(text) for text in texts]
        self.limits.check_chars(chars, keep, describe)

        async def encode(start: int, stop: int) -> list[list[int]]:
            return await self.tokenizer.encode_texts(texts[start:stop], max_length=keep)

        token_lists = await _in_chunks(chars, encode, self.limits, keep, describe)
        vectors = np.asarray(await self.engine.embed(token_lists), dtype=np.float64)
        left, right = vectors[: len(firsts)], vectors[len(firsts) :]
        norms = np.maximum(np.linalg.norm(left, axis=1) * np.linalg.norm(right, axis=1), 1e-12)
        cosines = (left * right).sum(axis=1) / norms  # a single first row broadcasts against every second
        return Scored([float(c) for c in cosines], sum(len(ids) for ids in token_lists))


async def _in_chunks(
    chars: list[int],
    encode: Callable[[int, int], Awaitable[list[T]]],
    limits: ScoreLimits,
    keep: int | None,
    describe: Describe,
) -> list[T]:
    """`encode(start, stop)` over ranges of about TOKENIZE_CHUNK_CHARS characters, each range's inputs checked
    (lengths, and the running total against the budget) before the next is tokenized."""
    found: list[T] = []
    tokens = start = 0
    while start < len(chars):
        stop, size = start, 0
        while stop < len(chars) and (stop == start or size + chars[stop] <= TOKENIZE_CHUNK_CHARS):
            size += chars[stop]
            stop += 1
        chunk = await encode(start, stop)
        lengths = [len(item) for item in chunk]
        limits.check_tokens(lengths, keep, describe, first=start)
        tokens += sum(lengths)
        limits.check_total(tokens, describe(stop - 1)[1])
        found += chunk
        start = stop
    return found
