"""The wire protocol of /v1/embeddings: OpenAI's request and response, with vLLM's `truncate_prompt_tokens`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from transformers_openai.protocol.base import Strict, Text
from transformers_openai.protocol.common import priority_field
from transformers_openai.protocol.text import TokenId

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request

TextInputs = Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
TokenInputs = Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class EmbeddingRequest(Strict):
    model: Text
    input: Text | TextInputs | Annotated[list[TokenId], Field(min_length=1)] | TokenInputs = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as the base64 of its little-endian float32 bytes"
    )
    dimensions: int | None = Field(
        None, ge=1, description="Cut the vectors to this size (and renormalize): only for models trained for it"
    )
    user: Text | None = None
    priority: int = priority_field()
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="Keep only the first N tokens of each input (-1: as many as the model takes) instead of "
        "refusing inputs that are longer",
    )

    @field_validator("input", mode="before")
    @classmethod
    def _not_empty(cls, value: object) -> object:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1, or -1 for the model's limit")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: of strings, or of token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [[int(t) for t in self.input if isinstance(t, int)]]
        return self.input  # type: ignore[return-value]  # a list of strings or of lists, as validated


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
