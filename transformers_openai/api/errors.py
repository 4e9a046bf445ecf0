"""Turns every failure into OpenAI's error shape with the right status (FastAPI's 422 becomes 400); on the Anthropic
Messages routes, into Anthropic's shape."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from transformers_openai.engine.errors import EngineError
from transformers_openai.serving.errors import (
    BadRequestError,
    NotFoundError,
    OpenAIError,
    to_openai_error,
)

logger = logging.getLogger(__name__)


# The routes that answer in Anthropic's error shape, with and without /v1.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens"})


def error_response(error: OpenAIError, path: str = "") -> JSONResponse:
    """The error as the route at `path` speaks: Anthropic's shape on the Messages routes, OpenAI's elsewhere."""
    body = error.anthropic_body() if path in ANTHROPIC_PATHS else error.body()
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers())


def validation_error(exc: RequestValidationError) -> BadRequestError:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return BadRequestError("invalid request")
    first = errors[0]
    param = _param(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "missing" and param is None:
        return BadRequestError("a JSON request body is required", code="missing_body")
    if kind == "json_invalid":
        return BadRequestError("the request body is not valid JSON", code="invalid_json")
    if param is None and isinstance(first.get("input"), bytes):  # a body FastAPI did not read as JSON
        return BadRequestError(
            "the request body must be JSON sent with 'Content-Type: application/json'", code="invalid_content_type"
        )
    if kind == "missing":
        return BadRequestError(f"'{param}' is required", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return BadRequestError(f"unknown or unsupported parameter '{param}'", param=param, code="unknown_parameter")
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return BadRequestError(f"{param}: {message}" if param else message, param=param, code="invalid_value")


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The request field an error is about: pydantic's location without 'body' and union-member tags."""
    parts: list[str] = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and part.endswith("[]") and part[:-2].isidentifier():
            parts.append(part)  # a form's array field (`timestamp_granularities[]`): named as the client sent it
            break
        if isinstance(part, str) and not part.isidentifier():
            if not parts:
                continue  # the tag of a body that is a union ('text-request' at /tokenize): its fields follow
            break  # a union member tag such as 'list[str]' or 'function-after[...]'
        if isinstance(part, str) and part in _UNION_TAGS:
            break
        parts.append(str(part))
    return ".".join(parts) or None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})

# Starlette's own refusals: a body FastAPI could not parse (e.g. an integer of thousands of digits), a wrong method.
_HTTP_ERROR_CODES = {400: "invalid_body", 405: "method_not_allowed"}


def _with_head(allow: str) -> str:
    """Every GET route answers HEAD too, from a route of its own (so the document lists it once): Starlette's
    Allow names only the first route of the path."""
    methods = [method.strip() for method in allow.split(",")]
    if "GET" in methods and "HEAD" not in methods:
        methods.append("HEAD")
    return ", ".join(methods)


def install_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        error = to_openai_error(exc)
        if error.status_code == 429:
            request.app.state.metrics.on_rejected()
        return error_response(error, request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc), request.url.path)

    async def on_too_deep(request: Request, __: Exception) -> JSONResponse:
        # JSON nested thousands deep (tool-call arguments, a schema) outruns Python's recursion limit wherever it is
        # decoded, validated or walked: the client's input, never the server's fault.
        logger.info("request refused: its input is nested too deeply")
        error = BadRequestError("the request is nested too deeply", code="nested_too_deeply")
        return error_response(error, request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return error_response(NotFoundError("no such route", code="not_found"))
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's refusal of a body json.loads could not read
            return await on_too_deep(request, exc.__cause__)
        error = OpenAIError(str(exc.detail), code=_HTTP_ERROR_CODES.get(exc.status_code))
        error.status_code = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = error_response(error, request.url.path)
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405
        if "allow" in response.headers:
            response.headers["allow"] = _with_head(response.headers["allow"])
        return response

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(to_openai_error(exc), request.url.path)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(EngineError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RecursionError, on_too_deep)
    app.add_exception_handler(Exception, on_unexpected)
