"""Anthropic's Messages API: create a message (JSON or Anthropic's named SSE events) and count a prompt's tokens.
Errors on these routes come in Anthropic's shape (api/errors.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from transformers_openai.api.model_pick import model_handlers, model_metrics
from transformers_openai.api.openapi import error_responses
from transformers_openai.api.routes import SSE_EVENT, body_context, json_body, respond
from transformers_openai.protocol.messages import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from transformers_openai.serving.messages.handler import MessagesHandler

_ERRORS = error_responses(400, 401, 404, 408, 413, 429, 503, body=AnthropicErrorResponse)
_CREATED: dict[int | str, dict[str, Any]] = {
    200: {
        "model": MessageResponse,
        "description": "The message; with stream=true, Server-Sent Events named by their type, from `message_start` "
        "to `message_stop` (or `error`)",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
    **_ERRORS,
}


async def _handler(request: Request, model: str | None) -> MessagesHandler:
    return (await model_handlers(request, model)).messages


async def _limits(request: Request) -> None:
    """Cheap limits on the raw body, before FastAPI validates it (its messages count as chat's)."""
    limits = (await body_context(request)).prompt_limits
    if limits is not None:
        limits.check_chat(await json_body(request))


def build_messages_router() -> APIRouter:
    router = APIRouter()

    @router.post("/messages", responses=_CREATED, response_model=None, dependencies=[Depends(_limits)])
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        handler = await _handler(request, body.model)
        model_metrics(request).on_request(handler.endpoint)
        return await respond(request, lambda wait, request_id: handler.create(body, wait, request_id))

    @router.post("/messages/count_tokens", responses=_ERRORS, dependencies=[Depends(_limits)])
    async def count_tokens(body: CountTokensRequest, request: Request) -> CountTokensResponse:
        handler = await _handler(request, body.model)
        model_metrics(request).on_request("messages_count_tokens")
        return await handler.count_tokens(body)

    return router
