"""Thin routes: parse, call the handler, return JSON or SSE. Each is served with and without /v1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from transformers_openai.api.model_pick import model_handlers, model_metrics, named_model, served_model
from transformers_openai.api.models_registry import ModelSlot
from transformers_openai.api.openapi import error_responses
from transformers_openai.api.sse import StreamEnds, sse_response
from transformers_openai.api.state import AppState
from transformers_openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from transformers_openai.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from transformers_openai.serving.base import GenerationHandler
from transformers_openai.serving.context import Capability, ServingContext
from transformers_openai.serving.disconnect import ClientDisconnected, WaitDisconnect
from transformers_openai.serving.errors import ServiceUnavailableError

# Not a standard status: what nginx logs when the client closed the connection first.
CLIENT_CLOSED_REQUEST = 499

# What every route may answer with our error body: the body checks (400, 413), the key (401), a slow client
# (408, from the connection guard), a busy or
# loading server (429, 503; at the connection limit even /metrics gets 503) and unknown models (404).
_ERRORS = error_responses(400, 401, 404, 408, 413, 429, 503)


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.serving
    return state


async def body_context(request: Request) -> ServingContext:
    """The context of the model the raw JSON body names (for the limits checked before FastAPI validates it)."""
    slot = await served_model(request, named_model(await json_body(request)))
    assert slot.context is not None  # a held model stays loaded
    return slot.context


async def _chat_limits(request: Request) -> None:
    """Cheap limits on the raw body, before FastAPI validates it (runs as a dependency, after the JSON parse)."""
    limits = (await body_context(request)).prompt_limits
    if limits is not None:
        limits.check_chat(await json_body(request))


async def _completion_limits(request: Request) -> None:
    limits = (await body_context(request)).prompt_limits
    if limits is not None:
        limits.check_completion(await json_body(request))


async def _tokenize_limits(request: Request) -> None:
    limits = (await body_context(request)).prompt_limits
    if limits is not None:
        limits.check_tokenize(await json_body(request))


async def _detokenize_limits(request: Request) -> None:
    context = await body_context(request)
    if context.prompt_limits is not None:
        context.prompt_limits.check_detokenize(await json_body(request), context.max_model_len)


async def json_body(request: Request) -> Any:
    try:
        return await request.json()  # FastAPI parsed it already: the parse is cached
    except ValueError:
        return None  # not JSON: validation answers that


def disconnect_waiter(request: Request) -> WaitDisconnect:
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


Create = Callable[[WaitDisconnect, str | None], Awaitable[BaseModel | str | AsyncIterator[BaseModel]]]


async def respond(request: Request, create: Create, text_media_type: str = "text/plain") -> Response:
    """Runs a handler's `create(wait_disconnect, request_id)` and answers with what it made: JSON, plain text
    (`text_media_type`) or Server-Sent Events; a client gone before a non-streaming answer gets 499."""
    request_id = request.scope.get("state", {}).get("request_id")  # set by RequestIdMiddleware
    try:
        result = await create(disconnect_waiter(request), request_id)
    except ClientDisconnected:
        model_metrics(request).on_client_disconnected()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    if isinstance(result, str):
        return Response(result, media_type=text_media_type)
    app = request.app
    stall_timeout_s = app.state.settings.stream_stall_timeout
    metrics = model_metrics(request)
    ends = StreamEnds(on_stall=metrics.on_stream_stalled, on_disconnect=metrics.on_client_disconnected)
    return sse_response(result, request_id or "-", stall_timeout_s, ends)


async def _generate(handler: GenerationHandler[Any], body: Any, request: Request) -> Response:
    model_metrics(request).on_request(handler.endpoint)
    return await respond(request, lambda wait, request_id: handler.create(body, wait, request_id))


# One Server-Sent Event (OpenAPI before 3.2 describes an event stream by its events).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "A chunk as JSON, an error as JSON, or `[DONE]` (the last)"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    ok = {
        "model": model,
        "description": "The completion; with stream=true, Server-Sent Events of chunks ending in `data: [DONE]`",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
    return {200: ok, **_ERRORS}


def _get(router: APIRouter, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A GET route that also answers HEAD (documented once, as GET)."""

    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        router.add_api_route(path, endpoint, methods=["GET"], **kwargs)
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False, **kwargs)
        return endpoint

    return register


# What each capability lets a client send, in the order cards list them.
_MODALITIES = (
    (Capability.TEXT, "text"),
    (Capability.EMBEDDINGS, "text"),
    (Capability.SCORES, "text"),
    (Capability.VISION, "image"),
    (Capability.SPEECH, "audio"),
)


def _model_card(slot: ModelSlot) -> ModelCard:
    """A listed model's card: with the inputs it reads and its limits while it is loaded."""
    context = slot.context
    if context is None:
        return ModelCard(id=slot.name, state=slot.state.value)
    capabilities = context.capabilities
    modalities = list(dict.fromkeys(name for capability, name in _MODALITIES if capability in capabilities))
    return ModelCard(
        id=context.model_name,
        max_model_len=context.max_model_len,
        quantization=context.quantization,
        input_modalities=modalities,
        state=slot.state.value,
    )


def _model_cards(state: AppState) -> list[ModelCard]:
    """Every listed model's card, each followed by its adapters'; one model answers 503 until loaded, as before."""
    if not state.registry.routed:
        state.context()
    cards = []
    for slot in state.registry.slots:
        cards.append(_model_card(slot))
        if slot.context is not None:
            cards.extend(slot.context.adapter_cards())  # its LoRA adapters, each with the model as `parent`
    return cards


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post(
        "/chat/completions",
        responses=_generation_responses(ChatCompletionResponse),
        dependencies=[Depends(_chat_limits)],
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate((await model_handlers(request, body.model)).chat, body, request)

    @router.post(
        "/completions", responses=_generation_responses(CompletionResponse), dependencies=[Depends(_completion_limits)]
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate((await model_handlers(request, body.model)).completions, body, request)

    @router.post("/tokenize", responses=_ERRORS, dependencies=[Depends(_tokenize_limits)])
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        handler = (await model_handlers(request, body.model)).tokenize
        model_metrics(request).on_request(handler.endpoint)
        return await handler.tokenize(body)

    @router.post("/detokenize", responses=_ERRORS, dependencies=[Depends(_detokenize_limits)])
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        handler = (await model_handlers(request, body.model)).tokenize
        model_metrics(request).on_request("detokenize")
        return await handler.detokenize(body)

    @_get(router, "/models", responses=_ERRORS)
    async def list_models(request: Request) -> ModelList:
        return ModelList(data=_model_cards(_state(request)))

    @_get(router, "/models/{model_id:path}", responses=_ERRORS)
    async def get_model(model_id: str, request: Request) -> ModelCard:
        state = _state(request)
        if not state.registry.routed:
            state.context().check_model(model_id)
        slot = state.registry.find(model_id)
        adapters = [card for card in slot.context.adapter_cards() if card.id == model_id] if slot.context else []
        return adapters[0] if adapters else _model_card(slot)

    return router


class Health(BaseModel):
    status: str
    engine: dict[str, Any]
    models: dict[str, Any] | None = None  # with several models: each one's state and engine


def _engine_stats(context: ServingContext) -> Any:
    stats = context.engine.stats()
    return vars(stats) if not isinstance(stats, dict) else stats


class Ready(BaseModel):
    status: str


class Load(BaseModel):
    load: int


def build_ops_router() -> APIRouter:
    """/health, /ready, /get_load and /metrics: outside /v1, for load balancers, routers and Prometheus."""
    router = APIRouter()

    @_get(
        router,
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}}
        | _ERRORS,
    )
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @_get(router, "/ready", response_model=Ready, responses=_ERRORS)
    async def ready(request: Request) -> Ready:
        """200 only while the model is loaded and the server takes requests: 503 while loading and once draining."""
        state = _state(request)
        if not state.ready():
            raise ServiceUnavailableError(state.status_message())
        return Ready(status="ready")

    @_get(router, "/get_load", response_model=Load, responses=_ERRORS)
    async def get_load(request: Request) -> Load:
        """The requests this server holds (running and waiting), as vLLM's router reads a worker's load."""
        state = _state(request)
        if not state.registry.routed:
            return Load(load=state.context().engine.stats().in_flight)
        return Load(load=sum(s.context.engine.stats().in_flight for s in state.registry.slots if s.context))

    @_get(router, "/health", response_model=Health, responses=_ERRORS)
    async def health(request: Request) -> JSONResponse:
        state = _state(request)
        if not state.ready():
            raise ServiceUnavailableError(state.status_message())
        if not state.registry.routed:
            return JSONResponse({"status": "ok", "engine": _engine_stats(state.context())})
        models = {
            slot.name: {"state": slot.state.value, "engine": _engine_stats(slot.context) if slot.context else None}
            for slot in state.registry.slots
        }
        return JSONResponse({"status": "ok", "engine": next(iter(models.values()))["engine"] or {}, "models": models})

    return router
