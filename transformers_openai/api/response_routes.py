"""/v1/responses: create a response (JSON or named SSE events), and get or delete a stored one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from transformers_openai.api.middleware import presented_key
from transformers_openai.api.model_pick import model_handlers, model_metrics
from transformers_openai.api.openapi import error_responses
from transformers_openai.api.routes import SSE_EVENT, body_context, json_body, respond
from transformers_openai.api.state import AppState
from transformers_openai.protocol.responses import DeletedResponse, ResponseObject, ResponsesRequest
from transformers_openai.serving.text.response_store import owner_of_key
from transformers_openai.serving.text.responses import ResponsesHandler

_ERRORS = error_responses(400, 401, 404, 408, 413, 429, 503)
_CREATED: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ResponseObject,
        "description": "The response; with stream=true, Server-Sent Events named by their type, from "
        "`response.created` to `response.completed` (or `response.incomplete`, or `error`)",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
    **_ERRORS,
}


async def _handler(request: Request, model: str | None) -> ResponsesHandler:
    return (await model_handlers(request, model)).responses


def _stored(request: Request, response_id: str) -> ResponsesHandler:
    """The handler whose store holds `response_id`: the one model's, or with several, the loaded text model's that
    knows it (the first text model's, whose 404 names it, when none does)."""
    state: AppState = request.app.state.serving
    if not state.registry.routed:
        return state.handlers().responses
    handlers = [s.handlers for s in state.registry.slots if s.handlers is not None and s.handlers.text is not None]
    for handler in handlers:
        if handler.responses.store.get(response_id, owner_of_request(request)) is not None:
            return handler.responses
    return handlers[0].responses if handlers else state.handlers().responses


def owner_of_request(request: Request) -> str | None:
    """Whose stored responses this request may see: the digest of its API key (which ApiKeyAuth has checked), or
    None on a server that takes no keys."""
    if not request.app.state.settings.api_keys:
        return None
    return owner_of_key((presented_key(request.scope) or b"").decode("latin-1"))


async def _limits(request: Request) -> None:
    """Cheap limits on the raw body, before FastAPI validates it (as chat's)."""
    limits = (await body_context(request)).prompt_limits
    if limits is not None:
        limits.check_responses(await json_body(request))


def build_responses_router() -> APIRouter:
    router = APIRouter()

    @router.post("/responses", responses=_CREATED, response_model=None, dependencies=[Depends(_limits)])
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        handler = await _handler(request, body.model)
        model_metrics(request).on_request(handler.endpoint)
        owner = owner_of_request(request)
        return await respond(request, lambda wait, request_id: handler.create(body, wait, request_id, owner))

    @router.get("/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str, request: Request) -> ResponseObject:
        return _stored(request, response_id).get(response_id, owner_of_request(request))

    @router.delete("/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str, request: Request) -> DeletedResponse:
        _stored(request, response_id).delete(response_id, owner_of_request(request))
        return DeletedResponse(id=response_id)

    return router
