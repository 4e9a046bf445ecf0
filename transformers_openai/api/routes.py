"""Thin routes: parse, call the handler, return JSON or SSE. Each is served with and without /v1."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from transformers_openai.api.sse import sse_response
from transformers_openai.api.state import AppState
from transformers_openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from transformers_openai.serving.base import ClientDisconnected, GenerationHandler, WaitDisconnect
from transformers_openai.serving.errors import ModelNotFoundError, ServiceUnavailableError

# Not a standard status: what nginx logs when the client closed the connection first.
CLIENT_CLOSED_REQUEST = 499


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.serving
    return state


def _disconnect_waiter(request: Request) -> WaitDisconnect:
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


async def _generate(handler: GenerationHandler[Any], body: Any, request: Request) -> Response:
    try:
        request_id = request.scope.get("state", {}).get("request_id")  # set by RequestIdMiddleware
        result = await handler.create(body, _disconnect_waiter(request), request_id)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return sse_response(result)


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(_state(request).handlers().chat, body, request)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(_state(request).handlers().completions, body, request)

    @router.api_route("/models", methods=["GET", "HEAD"])
    async def list_models(request: Request) -> ModelList:
        return ModelList(data=[_state(request).model_card()])

    @router.api_route("/models/{model_id:path}", methods=["GET", "HEAD"])
    async def get_model(model_id: str, request: Request) -> ModelCard:
        state = _state(request)
        if model_id not in state.model_aliases():
            raise ModelNotFoundError(f"the model '{model_id}' does not exist", param="model")
        return state.model_card()

    return router


def build_ops_router() -> APIRouter:
    """/health and /metrics: outside /v1, for load balancers and Prometheus."""
    router = APIRouter()

    @router.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> JSONResponse:
        state = _state(request)
        if not state.ready():
            raise ServiceUnavailableError(state.status_message())
        stats = state.context().engine.stats()
        return JSONResponse({"status": "ok", "engine": vars(stats) if not isinstance(stats, dict) else stats})

    return router
