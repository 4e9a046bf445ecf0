"""The nasty-input matrix for /v1/rerank and /v1/score: wrong types, lone surrogates, numbers past every bound, and
bodies past the length, character and token limits each get a 400 in our shape naming the field, before any
tokenizing or scoring; extreme values that are valid get their answer, never a 5xx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import MODEL, assert_error, make_app, running
from tests.app.test_app_embeddings import FakeEmbedder, embedding_context
from tests.app.test_app_scores import MAX_PAIR, TOKEN_CHARS, CountingPairs, FakePairScorer, cross_encoder_context
from transformers_openai.protocol.scores import MAX_SCORE_TEXTS
from transformers_openai.serving.context import Capability
from transformers_openai.serving.prompt_limits import PromptLimits

SURROGATE = "\ud800"
BUDGET = 200  # tokens a request may hold over all its pairs
MOST_CHARS = MAX_PAIR * TOKEN_CHARS  # a pair of more characters cannot fit the model's input
RERANK, SCORE = "/v1/rerank", "/v1/score"


def rerank(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "query": "q", "documents": ["a", "b"], **fields}


def score(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "text_1": "q", "text_2": ["a", "b"], **fields}


CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # lone surrogates
    ("query", RERANK, rerank(query=f"a{SURROGATE}"), "query"),
    ("document", RERANK, rerank(documents=["ok", SURROGATE]), "documents.1"),
    ("document object", RERANK, rerank(documents=[{"text": SURROGATE}]), "documents.0"),
    ("rerank model", RERANK, rerank(model=SURROGATE), "model"),
    ("text_1", SCORE, score(text_1=SURROGATE), "text_1"),
    ("text_1 item", SCORE, score(text_1=["a", SURROGATE]), "text_1"),
    ("text_2 item", SCORE, score(text_2=[SURROGATE]), "text_2"),
    ("score model", SCORE, score(model=SURROGATE), "model"),
    # no coercion, no shapes beside the documented ones
    ("query number", RERANK, rerank(query=5), "query"),
    ("query null", RERANK, rerank(query=None), "query"),
    ("query object", RERANK, rerank(query={"text": "q"}), "query"),
    ("documents null", RERANK, rerank(documents=None), "documents"),
    ("documents object", RERANK, rerank(documents={"text": "a"}), "documents"),
    ("documents string", RERANK, rerank(documents="a"), "documents"),
    ("documents of booleans", RERANK, rerank(documents=[True]), "documents.0"),
    ("documents of numbers", RERANK, rerank(documents=[1.5]), "documents.0"),
    ("document text null", RERANK, rerank(documents=[{"text": None}]), "documents.0"),
    ("document content parts", RERANK, rerank(documents=[{"content": [{"type": "text", "text": "a"}]}]), "documents.0"),
    ("documents nested", RERANK, rerank(documents=[[["a"]]]), "documents.0"),
    ("top_n string", RERANK, rerank(top_n="2"), "top_n"),
    ("top_n float", RERANK, rerank(top_n=2.0), "top_n"),
    ("top_n bool", RERANK, rerank(top_n=True), "top_n"),
    ("return_documents int", RERANK, rerank(return_documents=1), "return_documents"),
    ("return_documents string", RERANK, rerank(return_documents="false"), "return_documents"),
    ("truncate string", RERANK, rerank(truncate_prompt_tokens="5"), "truncate_prompt_tokens"),
    ("truncate float", SCORE, score(truncate_prompt_tokens=5.5), "truncate_prompt_tokens"),
    ("truncate -2", SCORE, score(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ("truncate 0", RERANK, rerank(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("text_1 bool", SCORE, score(text_1=True), "text_1"),
    ("text_1 null", SCORE, score(text_1=None), "text_1"),
    ("text_2 number", SCORE, score(text_2=3), "text_2"),
    ("text_2 nested", SCORE, score(text_2=[["a"]]), "text_2"),
    ("text_2 objects", SCORE, score(text_2=[{"text": "a"}]), "text_2"),
    ("unknown field", RERANK, rerank(rank_fields=["text"]), "rank_fields"),
    ("Cohere's chunks", RERANK, rerank(max_chunks_per_doc=2), "max_chunks_per_doc"),
    ("score's unknown field", SCORE, score(queries=["q"]), "queries"),
    # numbers and counts past every bound
    ("top_n 0", RERANK, rerank(top_n=0), "top_n"),
    ("top_n below 0", RERANK, rerank(top_n=-(2**64)), "top_n"),
    ("truncate 2**64", RERANK, rerank(truncate_prompt_tokens=2**64), "truncate_prompt_tokens"),
    ("truncate past the model", SCORE, score(truncate_prompt_tokens=MAX_PAIR + 1), "truncate_prompt_tokens"),
    ("no documents", RERANK, rerank(documents=[]), "documents"),
    ("empty query", RERANK, rerank(query=""), "query"),
    ("no text_1", SCORE, score(text_1=[]), "text_1"),
    ("no text_2", SCORE, score(text_2=[]), "text_2"),
    ("too many documents", RERANK, rerank(documents=["a"] * (MAX_SCORE_TEXTS + 1)), "documents"),
    ("too many texts", SCORE, score(text_1=["a"] * (MAX_SCORE_TEXTS + 1), text_2="b"), "text_1"),
    ("lists of two lengths", SCORE, score(text_1=["a", "b", "c"]), "text_1"),
    # past the character and token limits
    ("one pair over its characters", RERANK, rerank(documents=["ok", "a" * MOST_CHARS]), "documents"),
    ("a long query with every document", SCORE, score(text_1="a" * MOST_CHARS), "text_2"),
    ("characters over the budget", RERANK, rerank(documents=["a" * 300] * 6, truncate_prompt_tokens=-1), "documents"),
]


@pytest.fixture
def pair_scorer() -> FakePairScorer:
    return FakePairScorer()


@pytest.fixture
async def limited(bert_tokenizer: Any, pair_scorer: FakePairScorer) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    counting = CountingPairs(bert_tokenizer)
    context = cross_encoder_context(bert_tokenizer, pair_scorer, budget=BUDGET, service=counting)
    async with running(make_app(FakeEngine(), bert_tokenizer, loader=lambda: context)) as client:
        yield client, counting


async def post_raw(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body).encode()  # a lone surrogate travels as the escape "\ud800"
    return await client.post(path, content=raw, headers={"content-type": "application/json"})


async def test_nasty_input_gets_our_400_naming_the_field(
    limited: tuple[httpx.AsyncClient, CountingPairs], pair_scorer: FakePairScorer
) -> None:
    """One app for the whole matrix (an app per case would cost a second each): every case is tried, the failures
    reported together."""
    client, counting = limited
    failures = []
    for name, path, body, param in CASES:
        response = await post_raw(client, path, body)
        try:
            error = assert_error(response, 400)
            assert (error["param"] or "").startswith(param), error
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)
    assert pair_scorer.pairs == [] and counting.pairs == 0
    # Pairs within the budget's characters but over its tokens are refused once counted, before any scoring.
    over = score(text_2=["a " * 20] * 30, truncate_prompt_tokens=-1)
    assert_error(await post_raw(client, SCORE, over), 400, "text_2", "max_tokens_per_request")
    assert pair_scorer.pairs == []


async def test_extreme_but_valid_values_get_their_answer(
    limited: tuple[httpx.AsyncClient, CountingPairs], pair_scorer: FakePairScorer
) -> None:
    client, _ = limited
    answered = [
        (RERANK, rerank(top_n=2**64)),  # more than there are: all of them
        (RERANK, rerank(documents=["", ""])),  # empty documents are texts too: a pair of special tokens
        (RERANK, rerank(documents=[{"text": "a", "title": "t", "id": 5, "meta": {"x": [1]}}])),  # other keys ignored
        (RERANK, rerank(truncate_prompt_tokens=-1)),
        (SCORE, score(text_1=["a", "b"], text_2=["c", "d"])),
        (SCORE, score(text_2="b")),
    ]
    for path, body in answered:
        response = await post_raw(client, path, body)
        assert response.status_code == 200, (body, response.text)
    assert len(pair_scorer.pairs) == 2 + 2 + 1 + 2 + 2 + 1


async def test_nasty_input_to_an_embedding_model_gets_our_400(hf_tokenizer: Any) -> None:
    """The same routes scored by cosine similarity check each text on its own: a long query or text_1 is named."""
    embedder = FakeEmbedder()
    base = embedding_context(hf_tokenizer, embedder)
    assert base.embeddings is not None
    limits = PromptLimits(
        max_messages=8, max_content_parts=8, max_prompt_tokens=32, max_token_chars=TOKEN_CHARS, max_sequences=8
    )
    context = replace(
        base,
        capabilities=frozenset({Capability.EMBEDDINGS, Capability.SCORES}),
        prompt_limits=limits,
        embeddings=replace(base.embeddings, max_total_tokens=BUDGET),
    )
    long_text = "a" * (32 * TOKEN_CHARS + 1)
    cases = [
        (RERANK, rerank(query=long_text), "query"),
        (RERANK, rerank(documents=["ok", long_text]), "documents"),
        (SCORE, score(text_1=["a", long_text], text_2=["b", "c"]), "text_1"),
        (SCORE, score(text_2=["a " * 30] * 12, truncate_prompt_tokens=-1), "text_2"),
        (SCORE, score(truncate_prompt_tokens=33), "truncate_prompt_tokens"),
    ]
    async with running(make_app(FakeEngine(), hf_tokenizer, loader=lambda: context)) as client:
        for path, body, param in cases:
            error = assert_error(await post_raw(client, path, body), 400)
            assert (error["param"] or "").startswith(param), (body, error)
    assert embedder.inputs == []
