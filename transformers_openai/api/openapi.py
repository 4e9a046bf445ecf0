"""An honest /openapi.json: every status we answer with its schema, and none we never send (FastAPI's 422)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from transformers_openai.protocol import ErrorResponse

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the error names the parameter",
    401: "Missing or wrong API key (when the server requires one)",
    404: "Unknown model",
    408: "The request head or body came too slowly (--header-timeout, --body-timeout)",
    413: "Request body over the size limit",
    429: "Server at capacity; retry after the Retry-After seconds",
    503: "Model loading, or server shutting down",
}


def error_responses(*statuses: int, body: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each status with its error body (OpenAI's unless `body` says)."""
    return {status: {"model": body, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def install_openapi(app: FastAPI) -> None:
    """Builds the document once, without the 422 responses and validation schemas FastAPI adds by itself."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
