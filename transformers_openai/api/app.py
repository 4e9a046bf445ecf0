"""The app factory: routes, error mapping, middleware and a lifespan that loads the model and runs the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from transformers_openai import __version__
from transformers_openai.api.audio_routes import build_audio_router
from transformers_openai.api.batch_routes import build_batch_router
from transformers_openai.api.body_limit import BodySizeLimit
from transformers_openai.api.embedding_routes import build_embedding_router
from transformers_openai.api.errors import install_error_handlers
from transformers_openai.api.inflight import ByteBudget
from transformers_openai.api.lora_routes import build_lora_router
from transformers_openai.api.messages_routes import build_messages_router
from transformers_openai.api.middleware import (
    AllowedHosts,
    ApiKeyAuth,
    Cors,
    RequestIdMiddleware,
    ServerHeaders,
    allowed_hosts,
)
from transformers_openai.api.model_pick import ModelLeases, RoutedHandlers
from transformers_openai.api.models_registry import ModelRegistry, ModelSlot, ModelSource, RegistryPolicy
from transformers_openai.api.openapi import install_openapi
from transformers_openai.api.realtime_routes import RealtimeSlots, build_realtime_router
from transformers_openai.api.response_routes import build_responses_router
from transformers_openai.api.routes import build_ops_router, build_router
from transformers_openai.api.score_routes import build_cohere_v2_router, build_score_router
from transformers_openai.api.state import AppState, Loader
from transformers_openai.metrics import Metrics
from transformers_openai.serving.batch import BatchApi, BatchLimits
from transformers_openai.settings import Settings

OPS_PATHS = frozenset({"/health", "/ready", "/get_load", "/metrics"})
_FORM_OVERHEAD_BYTES = 1024 * 1024


def create_app(
    settings: Settings,
    loader: Loader,
    on_load_failure: Callable[[], None] | None = None,
    metrics: Metrics | None = None,
    models: list[ModelSource] | None = None,
    policy: RegistryPolicy | None = None,
) -> FastAPI:
    """Builds the app. `loader` builds the serving context (model, tokenizer, engine) in a worker thread; or with
    `models`, each listed model's loader builds its own (loaded as `policy` says), and `loader` is not used.

    `metrics` should be the observer the loader gave the engine, so /metrics shows the engine's work.
    """
    metrics = metrics or Metrics(settings.model_name, compat=settings.metrics_compat)
    sources = models or [ModelSource(settings.model_name, frozenset({settings.model_name}), loader, metrics=metrics)]
    registry = ModelRegistry(sources, policy, on_loaded=_on_loaded)
    state = AppState(registry)

    limits = BatchLimits(
        max_file_bytes=settings.max_batch_file_bytes,
        max_lines=settings.max_batch_lines,
        max_files=settings.max_batch_files,
        concurrency=settings.batch_concurrency,
    )
    batch_handlers = (lambda: RoutedHandlers(registry)) if registry.routed else state.handlers
    batch_api = BatchApi.under(settings.data_dir, limits, batch_handlers)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start(on_load_failure)
        batch_api.runner.start()
        try:
            yield
        finally:
            await batch_api.runner.stop()
            await state.stop()

    app = FastAPI(title="transformers-openai-api", version=__version__, lifespan=lifespan)
    app.state.serving = state
    app.state.batch_api = batch_api
    app.state.batch_handlers = batch_handlers
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.inflight_bytes = ByteBudget(settings.max_inflight_bytes)
    app.state.realtime_slots = RealtimeSlots(settings.max_realtime_sessions)
    install_error_handlers(app)
    install_openapi(app)
    router = build_router()
    audio = build_audio_router()
    responses = build_responses_router()
    embeddings = build_embedding_router()
    scores = build_score_router()
    messages = build_messages_router()
    batches = build_batch_router()
    realtime = build_realtime_router()
    lora = build_lora_router()
    for prefix in ("/v1", ""):
        app.include_router(router, prefix=prefix)
        app.include_router(audio, prefix=prefix)
        app.include_router(responses, prefix=prefix)
        app.include_router(embeddings, prefix=prefix)
        app.include_router(scores, prefix=prefix)
        app.include_router(messages, prefix=prefix)
        app.include_router(batches, prefix=prefix)
        app.include_router(realtime, prefix=prefix)
        app.include_router(lora, prefix=prefix)
    app.include_router(build_cohere_v2_router())
    app.include_router(build_ops_router())
    # Added innermost first. The Host check runs before anything else answers; CORS answers preflights before auth;
    # auth reads headers only, so a client without a key never holds any of the budget of body bytes in flight.
    # An upload's form may hold the largest audio or batch file accepted plus its other fields.
    largest_file = max(settings.max_audio_bytes, settings.max_batch_file_bytes)
    form_bytes = max(settings.max_request_bytes, largest_file + _FORM_OVERHEAD_BYTES)
    app.add_middleware(ModelLeases, registry=registry)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_request_bytes,
        budget=app.state.inflight_bytes,
        max_form_bytes=form_bytes,
    )
    if settings.api_keys:
        open_paths = frozenset() if settings.auth_health_and_metrics else OPS_PATHS
        app.add_middleware(ApiKeyAuth, keys=settings.api_keys, open_paths=open_paths.__contains__)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(ServerHeaders, replica_id=settings.replica_id, load=lambda: app.state.metrics.load)
    if settings.allowed_origins:
        app.add_middleware(
            Cors,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
            expose_headers=["x-request-id"],
        )
    app.add_middleware(AllowedHosts, hosts=allowed_hosts(settings.allowed_hosts, settings.host))
    return app


def _on_loaded(slot: ModelSlot) -> None:
    """A model just loaded: its metrics say what it is."""
    if slot.source.metrics is not None and slot.context is not None:
        slot.source.metrics.on_model_loaded(slot.context.model_kind, slot.context.quantization)
