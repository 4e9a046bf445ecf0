"""/v1/embeddings: a JSON body in, the vectors out (floats or base64)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from transformers_openai.api.model_pick import model_handlers, model_metrics
from transformers_openai.api.openapi import error_responses
from transformers_openai.api.routes import respond
from transformers_openai.protocol.embeddings import EmbeddingRequest, EmbeddingResponse


def build_embedding_router() -> APIRouter:
    router = APIRouter()

    @router.post(
        "/embeddings",
        responses={200: {"model": EmbeddingResponse}, **error_responses(400, 401, 404, 408, 413, 429, 503)},
        response_model=None,
    )
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        handler = (await model_handlers(request, body.model)).embeddings
        model_metrics(request).on_request("embeddings")
        return await respond(request, lambda wait, request_id: handler.create(body, wait, request_id))

    return router
