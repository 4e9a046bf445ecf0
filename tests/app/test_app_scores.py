"""/v1/rerank and /v1/score in process, on fake engines: a cross-encoder's pairs as the tokenizer makes them, the
answers' shapes and order, 1:1, 1:N and N:N pairing, cosine scores of an embedding model, truncation, the token
budget, and which model kinds serve which routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import MODEL, assert_error, make_app, running
from tests.app.test_app_embeddings import FakeEmbedder, embedding_context
from transformers_openai.engine.embedding_engine import TokenPair
from transformers_openai.serving.context import Capability, CrossEncoderModel, ServingContext
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.scoring import scorers
from transformers_openai.serving.tokenizer import TokenizerService

MAX_PAIR = 48  # tokens of one pair
TOKEN_CHARS = 8  # the most characters one token stands for, as these limits state it
QUERY = "what do wizards brew"
DOCUMENTS = ["Seven wizards mix bright potions.", "Stocks fell today.", "A lazy dog sleeps.", "Wizards brew tea."]
RERANK, SCORE = "/v1/rerank", "/v1/score"


class FakePairScorer:
    """A score per pair made from its token ids and types (so a wrong pairing or a lost type shows); records the
    pairs it was given."""

    def __init__(self) -> None:
        self.pairs: list[TokenPair] = []

    async def embed(self, inputs: list[TokenPair]) -> list[Any]:
        self.pairs.extend(inputs)
        return [np.array([expected_score(pair.ids, pair.type_ids)], dtype=np.float32) for pair in inputs]


def expected_score(ids: list[int], type_ids: list[int] | None) -> float:
    weights = np.arange(1, len(ids) + 1) * (1 + np.array(type_ids or [0] * len(ids)))
    return float(np.float32(np.sin(float(np.dot(ids, weights)))))


def cross_encoder_context(
    tokenizer: Any, engine: FakePairScorer, budget: int = 300_000, service: TokenizerService | None = None
) -> ServingContext:
    return ServingContext(
        engine=FakeEngine(),
        tokenizer=service or TokenizerService(tokenizer),
        model_name=MODEL,
        model_aliases=frozenset({MODEL}),
        max_model_len=MAX_PAIR,
        model_kind="cross-encoder",
        capabilities=frozenset({Capability.SCORES}),
        prompt_limits=PromptLimits(
            max_messages=8,
            max_content_parts=8,
            max_prompt_tokens=MAX_PAIR,
            max_token_chars=TOKEN_CHARS,
            max_sequences=8,
        ),
        cross_encoder=CrossEncoderModel(engine, MAX_PAIR, budget),
    )


@pytest.fixture
def pair_scorer() -> FakePairScorer:
    return FakePairScorer()


@pytest.fixture
async def cross_client(bert_tokenizer: Any, pair_scorer: FakePairScorer) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(FakeEngine(), bert_tokenizer, loader=lambda: cross_encoder_context(bert_tokenizer, pair_scorer))
    async with running(app) as ready:
        yield ready


def pair_scores(tokenizer: Any, firsts: list[str], seconds: list[str]) -> tuple[list[float], int]:
    """What the fake scorer gives each pair as the tokenizer makes it, and the pairs' tokens."""
    encoded = tokenizer(firsts, seconds)
    scores = [
        expected_score(ids, types) for ids, types in zip(encoded["input_ids"], encoded["token_type_ids"], strict=True)
    ]
    return scores, sum(len(ids) for ids in encoded["input_ids"])


async def test_rerank_sorts_the_documents_by_the_scores_of_their_pairs(
    cross_client: httpx.AsyncClient, pair_scorer: FakePairScorer, bert_tokenizer: Any
) -> None:
    documents: list[Any] = [*DOCUMENTS[:3], {"text": DOCUMENTS[3], "title": "tea"}]  # a document as an object too
    response = await cross_client.post(RERANK, json={"model": MODEL, "query": QUERY, "documents": documents})
    assert response.status_code == 200, response.text
    body = response.json()
    scores, tokens = pair_scores(bert_tokenizer, [QUERY] * 4, DOCUMENTS)
    order = sorted(range(4), key=lambda i: -scores[i])
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    encoded = bert_tokenizer([QUERY] * 4, DOCUMENTS)  # the pairs reach the model as the tokenizer makes them
    assert [(p.ids, p.type_ids) for p in pair_scorer.pairs] == list(
        zip(encoded["input_ids"], encoded["token_type_ids"], strict=True)
    )
    assert any(1 in (p.type_ids or []) for p in pair_scorer.pairs)
    for path in ("/rerank", "/v2/rerank"):  # the same answer on every path
        again = await cross_client.post(path, json={"model": MODEL, "query": QUERY, "documents": documents})
        assert again.json()["results"] == body["results"], path


async def test_rerank_top_n_return_documents_and_ties(cross_client: httpx.AsyncClient, bert_tokenizer: Any) -> None:
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    results = (await cross_client.post(RERANK, json=body)).json()["results"]
    scores, _ = pair_scores(bert_tokenizer, [QUERY] * 4, DOCUMENTS)
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -scores[i])[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in results)  # no document key at all
    every = (await cross_client.post(RERANK, json={**body, "top_n": 10})).json()["results"]
    assert len(every) == 4  # more than there are: all of them
    ties = {"model": MODEL, "query": QUERY, "documents": ["same", "other text", "same", "same"]}
    results = (await cross_client.post(RERANK, json=ties)).json()["results"]
    assert [r["index"] for r in results if r["index"] != 1] == [0, 2, 3]  # equal scores keep the documents' order


PAIRINGS: list[tuple[str | list[str], str | list[str]]] = [
    (QUERY, DOCUMENTS[0]),  # 1:1
    (QUERY, DOCUMENTS),  # 1:N
    ([QUERY], DOCUMENTS),  # 1:N, the one text in a list
    (DOCUMENTS[::-1], DOCUMENTS),  # N:N
]


async def test_score_pairs_as_vllm_does(cross_client: httpx.AsyncClient, bert_tokenizer: Any) -> None:
    for text_1, text_2 in PAIRINGS:
        response = await cross_client.post(SCORE, json={"model": MODEL, "text_1": text_1, "text_2": text_2})
        assert response.status_code == 200, response.text
        body = response.json()
        firsts = [text_1] if isinstance(text_1, str) else text_1
        seconds = [text_2] if isinstance(text_2, str) else text_2
        scores, tokens = pair_scores(bert_tokenizer, firsts * len(seconds) if len(firsts) == 1 else firsts, seconds)
        assert [d["index"] for d in body["data"]] == list(range(len(seconds)))
        assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-6)
        assert {d["object"] for d in body["data"]} == {"score"} and body["object"] == "list"
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert body["id"].startswith("score-") and isinstance(body["created"], int)


async def test_long_pairs_are_refused_unless_truncation_is_asked(
    cross_client: httpx.AsyncClient, pair_scorer: FakePairScorer, bert_tokenizer: Any
) -> None:
    long_document = "word " * 60  # 60 tokens and the query's: over the pair's 48
    documents = ["short", long_document]
    body = {"model": MODEL, "query": QUERY, "documents": documents}
    error = assert_error(await cross_client.post(RERANK, json=body), 400, "documents", "context_length_exceeded")
    assert "documents[1]" in error["message"] and "truncate_prompt_tokens" in error["message"]
    cut = await cross_client.post(RERANK, json={**body, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200, cut.text
    assert [len(p) for p in pair_scorer.pairs] == [len(bert_tokenizer(QUERY, "short")["input_ids"]), MAX_PAIR]
    kept = bert_tokenizer(QUERY, long_document, truncation=True, max_length=20)["input_ids"]
    await cross_client.post(
        SCORE, json={"model": MODEL, "text_1": QUERY, "text_2": long_document, "truncate_prompt_tokens": 20}
    )
    assert pair_scorer.pairs[-1].ids == kept  # cut as the tokenizer cuts a pair, its special tokens kept
    over = {**body, "truncate_prompt_tokens": MAX_PAIR + 1}
    assert_error(await cross_client.post(RERANK, json=over), 400, "truncate_prompt_tokens")
    too_few = {**body, "truncate_prompt_tokens": 2}  # fewer than a pair's three special tokens
    error = assert_error(await cross_client.post(RERANK, json=too_few), 400, "truncate_prompt_tokens")
    assert "special tokens" in error["message"]
    assert len(pair_scorer.pairs) == 3


BAD_RERANK: list[tuple[dict[str, Any], str]] = [
    ({"documents": []}, "documents"),
    ({"top_n": 0}, "top_n"),
    ({"top_n": -1}, "top_n"),
    ({"documents": ["ok", 5]}, "documents.1"),
    ({"documents": ["ok", None]}, "documents.1"),
    ({"documents": [["nested"]]}, "documents.0"),
    ({"documents": [{"title": "no text"}]}, "documents.0"),
    ({"documents": [{"text": 5}]}, "documents.0"),
    ({"documents": "one string"}, "documents"),
    ({"query": ""}, "query"),
    ({"query": ["a list"]}, "query"),
    ({"return_documents": "yes"}, "return_documents"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"rank_fields": ["text"]}, "rank_fields"),
]
BAD_SCORE: list[tuple[dict[str, Any], str]] = [
    ({"text_1": []}, "text_1"),
    ({"text_2": []}, "text_2"),
    ({"text_2": [1, 2]}, "text_2"),
    ({"text_1": None}, "text_1"),
    ({"text_2": {"text": "x"}}, "text_2"),
    ({"text_1": [["a"]]}, "text_1"),
]


async def test_bad_bodies_get_a_400_naming_the_field_and_an_unknown_model_a_404(
    cross_client: httpx.AsyncClient, pair_scorer: FakePairScorer
) -> None:
    for body, param in BAD_RERANK:
        request = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, **body}
        assert_error(await cross_client.post(RERANK, json=request), 400, param)
    for body, param in BAD_SCORE:
        request = {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS, **body}
        assert_error(await cross_client.post(SCORE, json=request), 400, param)
    mismatched = {"model": MODEL, "text_1": DOCUMENTS[:2], "text_2": DOCUMENTS}
    error = assert_error(await cross_client.post(SCORE, json=mismatched), 400, "text_1")
    assert "1:1, 1:N or N:N" in error["message"]
    unknown = {"model": "other", "query": QUERY, "documents": DOCUMENTS}
    assert_error(await cross_client.post(RERANK, json=unknown), 404, "model", "model_not_found")
    assert pair_scorer.pairs == []


class CountingPairs(TokenizerService):
    """Counts the pairs handed to the tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.pairs = 0

    async def encode_pairs(
        self, firsts: list[str], seconds: list[str], max_length: int | None = None
    ) -> list[tuple[list[int], list[int] | None]]:
        self.pairs += len(firsts)
        return await super().encode_pairs(firsts, seconds, max_length)


async def test_the_token_budget_counts_every_pair_and_stops_at_the_chunk_past_it(
    bert_tokenizer: Any, pair_scorer: FakePairScorer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scorers, "TOKENIZE_CHUNK_CHARS", 40)  # a pair a chunk
    per_pair = len(bert_tokenizer(QUERY, DOCUMENTS[0])["input_ids"])
    budget = 3 * per_pair
    counting = CountingPairs(bert_tokenizer)
    context = cross_encoder_context(bert_tokenizer, pair_scorer, budget=budget, service=counting)
    async with running(make_app(FakeEngine(), bert_tokenizer, loader=lambda: context)) as client:
        within = {"model": MODEL, "query": QUERY, "documents": [DOCUMENTS[0]] * 3}
        assert (await client.post(RERANK, json=within)).status_code == 200
        over = {**within, "documents": [DOCUMENTS[0]] * 6}  # within the budget's characters, over its tokens
        error = assert_error(await client.post(RERANK, json=over), 400, "documents", "max_tokens_per_request")
        assert f"{4 * per_pair} tokens" in error["message"] and "--max-embedding-tokens" in error["message"]
        assert counting.pairs == 3 + 4  # the fourth pair's chunk passed the budget: the rest were never tokenized
        # Refused unread: a pair of more characters than the model's tokens could stand for, and pairs of more than
        # the budget's (even cut to the model's length).
        one = {**within, "documents": ["x" * (MAX_PAIR * TOKEN_CHARS + 1)]}
        assert_error(await client.post(RERANK, json=one), 400, "documents", "context_length_exceeded")
        many = {**within, "documents": ["x" * 200] * 2, "truncate_prompt_tokens": -1}
        assert_error(await client.post(RERANK, json=many), 400, "documents", "max_tokens_per_request")
        assert counting.pairs == 7
    assert len(pair_scorer.pairs) == 3


async def test_an_embedding_model_scores_by_cosine_similarity(hf_tokenizer: Any) -> None:
    embedder = FakeEmbedder()
    base = embedding_context(hf_tokenizer, embedder)
    context = replace(base, capabilities=frozenset({Capability.EMBEDDINGS, Capability.SCORES}))
    async with running(make_app(FakeEngine(), hf_tokenizer, loader=lambda: context)) as client:
        rerank = (await client.post(RERANK, json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS})).json()
        score = await client.post(SCORE, json={"model": MODEL, "text_1": DOCUMENTS[::-1], "text_2": DOCUMENTS})
        vectors = await embedder.embed([hf_tokenizer.encode(t) for t in [QUERY, *DOCUMENTS]])
        unit = np.array(vectors) / np.linalg.norm(np.array(vectors), axis=1, keepdims=True)
        cosines = unit[1:] @ unit[0]
        assert [r["index"] for r in rerank["results"]] == sorted(range(4), key=lambda i: -cosines[i])
        assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx(
            sorted(cosines, reverse=True), abs=1e-6
        )
        tokens = sum(len(hf_tokenizer.encode(t)) for t in [QUERY, *DOCUMENTS])
        assert rerank["usage"]["total_tokens"] == tokens  # the query embedded once, not once per document
        pairs = (unit[1:][::-1] * unit[1:]).sum(axis=1)
        assert [d["score"] for d in score.json()["data"]] == pytest.approx(pairs, abs=1e-6)
        embedded = await client.post("/v1/embeddings", json={"model": MODEL, "input": "still embeds"})
        assert embedded.status_code == 200


async def test_which_kinds_serve_which_routes(cross_client: httpx.AsyncClient, client: httpx.AsyncClient) -> None:
    for path, body in ((RERANK, {"query": "q", "documents": ["d"]}), (SCORE, {"text_1": "q", "text_2": "d"})):
        error = assert_error(await client.post(path, json={"model": MODEL, **body}), 400, "model")  # a text model
        assert error["code"] == "model_not_supported" and "cross-encoders" in error["message"]
    error = assert_error(await cross_client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}), 400, "model")
    assert error["code"] == "model_not_supported" and "/v1/rerank" in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(await cross_client.post("/v1/chat/completions", json=chat), 400, "model")
    assert "cross-encoder" in error["message"] and "/v1/score" in error["message"]
    tokenized = await cross_client.post("/tokenize", json={"prompt": "a cross-encoder still tokenizes"})
    assert tokenized.status_code == 200
    card = (await cross_client.get("/v1/models")).json()["data"][0]
    assert card["input_modalities"] == ["text"]
