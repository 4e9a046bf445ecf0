"""/v1/load_lora_adapter and /v1/unload_lora_adapter: a LoRA adapter loaded or unloaded at run time (vLLM's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from transformers_openai.api.openapi import error_responses
from transformers_openai.api.state import AppState
from transformers_openai.protocol.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from transformers_openai.serving.lora import LoraHandler

_ERRORS = error_responses(400, 401, 404, 413, 429, 503)
_PLAIN_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}  # vLLM's answer: one line of text
_ANSWERS: dict[int | str, dict[str, Any]] = {200: _PLAIN_TEXT, **_ERRORS}


def build_lora_router() -> APIRouter:
    """The routes served with and without the /v1 prefix."""
    router = APIRouter()

    @router.post("/load_lora_adapter", responses=_ANSWERS, response_model=None)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        return PlainTextResponse(await _handler(request).load(body))

    @router.post("/unload_lora_adapter", responses=_ANSWERS, response_model=None)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        return PlainTextResponse(await _handler(request).unload(body))

    return router


def _handler(request: Request) -> LoraHandler:
    state: AppState = request.app.state.serving
    return LoraHandler(state.context())
