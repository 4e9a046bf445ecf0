"""The wire protocol of /v1/rerank (Jina's and Cohere's shape, as vLLM serves it) and /v1/score (vLLM's)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from transformers_openai.protocol.base import Strict, Text

MAX_SCORE_TEXTS = 10_000  # documents of one rerank request, or texts on one side of a score request (Cohere's bound)

TRUNCATE_DESCRIPTION = (
    "Keep only the first N tokens of each pair (a cross-encoder's query and document together, cut from the longer "
    "first) or of each text (an embedding model's); -1: as many as the model takes. Without it, a longer input is "
    "refused"
)


def _not_zero(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("must be at least 1, or -1 for the model's limit")
    return value


class RerankDocument(BaseModel):
    """A document as an object (Jina's and Cohere's form). Keys beside `text` (a title, an id) are the client's own
    record of the document: ignored without a word (a warning per key would repeat for every document)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    text: Text


Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_SCORE_TEXTS)]


def _unicode_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"contains invalid Unicode (a lone surrogate at position {exc.start})"
    return None


def _document_shape(value: object) -> object:
    """One clear refusal for a document of another shape (rather than the first of the union's refusals)."""
    text = value.get("text") if isinstance(value, dict) else value
    if not isinstance(text, str):
        raise ValueError("must be a string or an object with a string 'text'")
    problem = _unicode_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return value


def _texts_shape(value: object) -> object:
    """`text_1` and `text_2`: one clear refusal for anything but a string or a list of strings."""
    if isinstance(value, str) or not isinstance(value, list):
        return value  # a string is checked as Text; another type gets the union's refusal
    if not value:
        raise ValueError("must not be an empty list")
    for i, item in enumerate(value):
        problem = "is not a string" if not isinstance(item, str) else _unicode_problem(item)
        if problem is not None:
            raise ValueError(f"item {i} {problem}: give a string or a list of strings")
    return value


Document = Annotated[Text | RerankDocument, BeforeValidator(_document_shape)]


class RerankRequest(Strict):
    model: Text
    query: Text = Field(min_length=1)
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_SCORE_TEXTS)] = Field(
        description="The documents to rank against the query: strings, or objects with a `text`"
    )
    top_n: int | None = Field(None, ge=1, description="Return only the N most relevant (default: all of them)")
    return_documents: bool = Field(True, description="Give each result its document's text back")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION)

    _truncate = field_validator("truncate_prompt_tokens")(_not_zero)

    def texts(self) -> list[str]:
        """The documents' texts, in their order."""
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class RerankedDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="The document's position in the request's `documents`")
    relevance_score: float
    document: RerankedDocument | None = Field(default=None, exclude_if=lambda value: value is None)


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult] = Field(description="The documents, most relevant first")
    usage: ScoreUsage


class ScoreRequest(Strict):
    model: Text
    text_1: Text | Texts = Field(description="One text scored against each of text_2, or a list as long as text_2")
    text_2: Text | Texts = Field(description="The texts paired with text_1 (1:1, 1:N or N:N)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION)

    _truncate = field_validator("truncate_prompt_tokens")(_not_zero)

    _shape = field_validator("text_1", "text_2", mode="before")(_texts_shape)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
