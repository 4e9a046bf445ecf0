"""One page of a list answer (GET /v1/files, GET /v1/batches), as OpenAI pages them: `limit` items after a cursor."""

from __future__ import annotations

from typing import Any, Protocol

from transformers_openai.serving.errors import BadRequestError


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


def check_limit(limit: int, most: int) -> None:
    """A 400 naming `limit` unless it is between 1 and `most`."""
    if not 1 <= limit <= most:
        raise BadRequestError(f"limit must be between 1 and {most}", param="limit", code="invalid_value")


def page_fields(found: list[Any], limit: int) -> dict[str, Any]:
    """The list answer's fields from up to `limit + 1` items found: one more than the page says there are more."""
    page: list[_HasId] = found[:limit]
    return {
        "data": page,
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(found) > limit,
    }
