"""/v1/rerank and /v1/score: the pairs a request makes, scored by the model's scorer, answered in each route's shape.

Rerank pairs the query with every document and answers the documents most relevant first (ties in the documents'
order), `top_n` of them. Score pairs `text_1` with `text_2` as vLLM does: one text with one (1:1), one with each of
a list (1:N), or two lists of the same length item by item (N:N); its answer keeps the pairs' order.
"""

from __future__ import annotations

import uuid

from transformers_openai.protocol.scores import (
    RerankedDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.disconnect import WaitDisconnect, until_disconnect
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.scoring.scorers import CosineScorer, CrossEncoderScorer, Scored, Scorer, Sides

RERANK_SIDES = Sides(first="query", second="documents")


def scorer_for(ctx: ServingContext) -> Scorer:
    """A cross-encoder's own scores, else an embedding model's cosine similarity."""
    token_chars = max(1, ctx.prompt_limits.max_token_chars) if ctx.prompt_limits is not None else 0
    if ctx.cross_encoder is not None:
        return CrossEncoderScorer(ctx.tokenizer, ctx.cross_encoder, token_chars)
    if ctx.embeddings is not None:
        return CosineScorer(ctx.tokenizer, ctx.embeddings, token_chars)
    raise ValueError("a score handler needs a cross-encoder or an embedding model")


class ScoreHandler:
    """Serves /v1/rerank and /v1/score for a cross-encoder or an embedding model."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.scorer = scorer_for(ctx)

    async def rerank(
        self, request: RerankRequest, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> RerankResponse:
        self.ctx.check_model(request.model)
        request_id = request_id or uuid.uuid4().hex
        documents = request.texts()
        scored = await self._score(
            [request.query], documents, request.truncate_prompt_tokens, RERANK_SIDES, wait_disconnect, request_id
        )
        order = sorted(range(len(documents)), key=lambda i: -scored.scores[i])  # a stable sort: ties keep their order
        results = [
            RerankResult(
                index=i,
                relevance_score=scored.scores[i],
                document=RerankedDocument(text=documents[i]) if request.return_documents else None,
            )
            for i in order[: request.top_n]
        ]
        usage = ScoreUsage(prompt_tokens=scored.tokens, total_tokens=scored.tokens)
        return RerankResponse(id=f"rerank-{request_id}", model=request.model, results=results, usage=usage)

    async def score(
        self, request: ScoreRequest, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> ScoreResponse:
        self.ctx.check_model(request.model)
        request_id = request_id or uuid.uuid4().hex
        firsts = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        seconds = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise BadRequestError(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 for all of text_2, or as "
                "many as text_2 (pairs 1:1, 1:N or N:N)",
                param="text_1",
            )
        sides = Sides("text_1", "text_2", not isinstance(request.text_1, str), not isinstance(request.text_2, str))
        scored = await self._score(firsts, seconds, request.truncate_prompt_tokens, sides, wait_disconnect, request_id)
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scored.scores)]
        usage = ScoreUsage(prompt_tokens=scored.tokens, total_tokens=scored.tokens)
        return ScoreResponse(id=f"score-{request_id}", model=request.model, data=data, usage=usage)

    async def _score(
        self,
        firsts: list[str],
        seconds: list[str],
        truncate: int | None,
        sides: Sides,
        wait_disconnect: WaitDisconnect,
        request_id: str,
    ) -> Scored:
        """The pairs' scores; tokenizing is watched too: a client that leaves stops it at the next chunk."""
        return await until_disconnect(self.scorer.score(firsts, seconds, truncate, sides), wait_disconnect, request_id)
