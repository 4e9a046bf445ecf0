"""Which served model answers a request: picked by its `model` field, loaded if need be, and held until the response
has gone out (the `ModelLeases` middleware lets it go), so an idle unload never takes a model from under a stream."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from transformers_openai.api.handlers import Handlers
from transformers_openai.api.models_registry import ModelRegistry, ModelSlot
from transformers_openai.api.state import AppState
from transformers_openai.metrics import Metrics

_SLOT = "model_slot"


async def served_model(request: Request, name: str | None) -> ModelSlot:
    """The model named `name` (the request's `model`), held for this request; asked once per request."""
    slot: ModelSlot | None = request.scope.setdefault("state", {}).get(_SLOT)
    if slot is None:
        state: AppState = request.app.state.serving
        slot = await state.acquire(name)
        request.scope["state"][_SLOT] = slot
    return slot


async def model_handlers(request: Request, name: str | None) -> Handlers:
    slot = await served_model(request, name)
    assert slot.handlers is not None  # a held model stays loaded
    return slot.handlers


def named_model(body: Any) -> str | None:
    """The `model` a raw JSON body names, if it names one."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def model_metrics(request: Request) -> Metrics:
    """The metrics labelled with the request's model (the server's own before a model is picked)."""
    slot: ModelSlot | None = request.scope.get("state", {}).get(_SLOT)
    if slot is not None and slot.source.metrics is not None:
        return slot.source.metrics
    metrics: Metrics = request.app.state.metrics
    return metrics


class ModelLeases:
    """Lets go of the model a request held once its response has gone out (streams included)."""

    def __init__(self, app: ASGIApp, registry: ModelRegistry) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        try:
            await self.app(scope, receive, send)
        finally:
            slot = state.pop(_SLOT, None)
            if slot is not None:
                self.registry.release(slot)


class _Routed:
    """One endpoint family's handler as a batch line calls it, picked per request by its model."""

    def __init__(self, registry: ModelRegistry, family: str) -> None:
        self._registry = registry
        self._family = family

    async def create(self, request: Any, wait_disconnect: Any, request_id: str | None = None) -> Any:
        slot = await self._registry.acquire(getattr(request, "model", None))
        try:
            assert slot.handlers is not None  # a held model stays loaded
            return await getattr(slot.handlers, self._family).create(request, wait_disconnect, request_id)
        finally:
            self._registry.release(slot)


class RoutedHandlers:
    """The Batch API's handlers on a server with several models: each line goes to the model it names."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.chat = _Routed(registry, "chat")
        self.completions = _Routed(registry, "completions")
        self.embeddings = _Routed(registry, "embeddings")
        self.responses = _Routed(registry, "responses")
