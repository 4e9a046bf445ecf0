"""The app factory: routes, error mapping, body limit and a lifespan that loads the model and runs the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from transformers_openai import __version__
from transformers_openai.api.body_limit import BodySizeLimit
from transformers_openai.api.errors import install_error_handlers
from transformers_openai.api.routes import build_health_router, build_router
from transformers_openai.api.state import AppState, Loader
from transformers_openai.settings import Settings


def create_app(settings: Settings, loader: Loader, on_load_failure: Callable[[], None] | None = None) -> FastAPI:
    """Builds the app. `loader` builds the serving context (model, tokenizer, engine) in a worker thread."""
    state = AppState(loader)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start(on_load_failure)
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="transformers-openai-api", version=__version__, lifespan=lifespan)
    app.state.serving = state
    app.state.settings = settings
    install_error_handlers(app)
    router = build_router()
    app.include_router(router, prefix="/v1")
    app.include_router(router)
    app.include_router(build_health_router())
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    return app
