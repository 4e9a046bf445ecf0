"""/v1/rerank (also Cohere's /v2/rerank) and /v1/score: a JSON body in, the scores out."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from transformers_openai.api.model_pick import model_handlers, model_metrics
from transformers_openai.api.openapi import error_responses
from transformers_openai.api.routes import respond
from transformers_openai.protocol.scores import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse

_ERRORS = error_responses(400, 401, 404, 408, 413, 429, 503)


def build_score_router() -> APIRouter:
    """The routes served with and without the /v1 prefix."""
    router = APIRouter()

    @router.post("/rerank", responses={200: {"model": RerankResponse}, **_ERRORS}, response_model=None)
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await _rerank(body, request)

    @router.post("/score", responses={200: {"model": ScoreResponse}, **_ERRORS}, response_model=None)
    async def score(body: ScoreRequest, request: Request) -> Response:
        handler = (await model_handlers(request, body.model)).scores
        model_metrics(request).on_request("score")
        return await respond(request, lambda wait, request_id: handler.score(body, wait, request_id))

    return router


def build_cohere_v2_router() -> APIRouter:
    """Cohere's v2 path of rerank (its SDK's `ClientV2.rerank`), answered as /v1/rerank is."""
    router = APIRouter()

    # Not in /openapi.json: the same operation as /v1/rerank (it is documented there).
    @router.post("/v2/rerank", response_model=None, include_in_schema=False)
    async def rerank_v2(body: RerankRequest, request: Request) -> Response:
        return await _rerank(body, request)

    return router


async def _rerank(body: RerankRequest, request: Request) -> Response:
    handler = (await model_handlers(request, body.model)).scores
    model_metrics(request).on_request("rerank")
    return await respond(request, lambda wait, request_id: handler.rerank(body, wait, request_id))
