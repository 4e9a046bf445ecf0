"""What every endpoint family shares on the wire: the error body and the model list."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

# vLLM's per-request `priority`: lower is served first. Batch API lines run at BATCH_PRIORITY, past every value a
# client may send, so they take only the capacity interactive requests leave.
MAX_PRIORITY = 2**31 - 1
BATCH_PRIORITY = MAX_PRIORITY + 1


def priority_field() -> Any:
    """The `priority` field of a generation or embedding request."""
    return Field(
        0,
        ge=-(2**31),
        le=MAX_PRIORITY,
        description="Lower is served first (vLLM's): waiting requests are admitted by priority, then arrival",
    )


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "transformers-openai-api"
    max_model_len: int | None = None
    quantization: str | None = None  # how the served weights are quantized ("none" when they are not)
    # What the model reads ("text", "image", "audio"), as vLLM's and OpenRouter's model cards say it.
    input_modalities: list[str] | None = None
    # A LoRA adapter's card: where it was read from and the model it adapts (vLLM's fields).
    root: str | None = None
    parent: str | None = None
    # Whether the model is in memory now: loaded, loading, unloaded (loaded on the first request naming it) or failed.
    state: Literal["loaded", "loading", "unloaded", "failed"] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
