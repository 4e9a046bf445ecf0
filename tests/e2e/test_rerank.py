"""/v1/rerank and /v1/score end to end on a cross-encoder (the tiny random BERT with one label): scores equal to the
model run on each pair alone and to sentence-transformers' CrossEncoder, under 16 concurrent requests; LiteLLM's
hosted_vllm rerank; schemathesis on both routes. MiniLM's cosine scores are in test_embeddings.py."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import schemathesis
from schemathesis import GenerationMode

from tests.e2e.fuzz_schema import pin_model
from tests.e2e.server import ServerProcess, start_server
from tests.e2e.test_embeddings import mixed_texts
from tests.e2e.test_schemathesis import fuzz

REQUESTS = 16
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def cross_encoder_server(tiny_cross_encoder_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_cross_encoder_dir, server_logs, "--max-batch-size", "32")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_cross_encoder_dir: Path) -> Any:
    """The model's own scores: each (query, document) pair alone, through sentence-transformers' CrossEncoder
    (its tokenization, its default activation for one label) and through transformers directly."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_cross_encoder_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_cross_encoder_dir, dtype=torch.float32).eval()
    cross_encoder = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu")

    def scores(pairs: list[tuple[str, str]]) -> np.ndarray:
        with torch.inference_mode():
            alone = [torch.sigmoid(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]) for a, b in pairs]
        direct = np.array([float(s) for s in alone])
        assert np.allclose(cross_encoder.predict(pairs, batch_size=1), direct, atol=TOLERANCE)  # the same scores
        return direct

    return scores


def queries_and_documents() -> list[tuple[str, list[str]]]:
    """Each request's query and documents: 3 to 9 documents of 1 to 120 words, in no length order."""
    texts = mixed_texts(count=REQUESTS * 7, longest_words=120)
    rng = np.random.default_rng(1)
    found, start = [], 0
    for i in range(REQUESTS):
        count = int(rng.integers(3, 10))
        found.append((texts[-1 - i][:60], texts[start : start + count]))
        start += count
    return found


def test_rerank_equals_the_model_on_each_pair_under_concurrency(
    cross_encoder_server: ServerProcess, reference: Any
) -> None:
    requests = queries_and_documents()
    before = cross_encoder_server.engine_state()

    def send(request: tuple[str, list[str]]) -> dict[str, Any]:
        query, documents = request
        body = {"model": "test-model", "query": query, "documents": documents}
        response = httpx.post(f"{cross_encoder_server.base_url}/rerank", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    with ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(send, requests))
    after = cross_encoder_server.engine_state()
    for (query, documents), answer in zip(requests, answers, strict=True):
        expected = reference([(query, doc) for doc in documents])
        results = answer["results"]
        assert sorted(r["index"] for r in results) == list(range(len(documents)))
        got = np.array([r["relevance_score"] for r in results])
        assert np.all(np.diff(got) <= 0), got  # most relevant first
        assert np.abs(got - expected[[r["index"] for r in results]]).max() < TOLERANCE
        assert [r["document"]["text"] for r in results] == [documents[r["index"]] for r in results]
    pairs = sum(len(documents) for _, documents in requests)
    assert after["requests"] - before["requests"] == REQUESTS
    assert after["inputs"] - before["inputs"] == pairs  # every pair ran once, on the embedding engine


def test_score_equals_the_model_on_its_pairs_under_concurrency(
    cross_encoder_server: ServerProcess, reference: Any
) -> None:
    requests = queries_and_documents()
    # Half the requests pair one text with many (1:N), half two lists item by item (N:N).
    bodies: list[dict[str, Any]] = [
        {"text_1": query if i % 2 else [doc[::-1] for doc in documents], "text_2": documents}
        for i, (query, documents) in enumerate(requests)
    ]

    def send(body: dict[str, Any]) -> list[float]:
        response = httpx.post(
            f"{cross_encoder_server.root_url}/score", json={"model": "test-model", **body}, timeout=120
        )
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        assert [d["index"] for d in data] == list(range(len(body["text_2"])))
        return [d["score"] for d in data]

    with ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(send, bodies))
    for body, got in zip(bodies, answers, strict=True):
        firsts = [body["text_1"]] * len(body["text_2"]) if isinstance(body["text_1"], str) else body["text_1"]
        expected = reference(list(zip(firsts, body["text_2"], strict=True)))
        assert np.abs(np.array(got) - expected).max() < TOLERANCE


def test_litellm_hosted_vllm_rerank(cross_encoder_server: ServerProcess, reference: Any) -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # read at import: no network
    import litellm

    query, documents = queries_and_documents()[0]
    response: Any = litellm.rerank(
        model="hosted_vllm/test-model",
        api_base=cross_encoder_server.root_url,
        api_key="unused",
        query=query,
        documents=documents,
        top_n=2,
    )
    expected = reference([(query, doc) for doc in documents])
    best = np.argsort(-expected, kind="stable")[:2]
    assert [r["index"] for r in response.results] == best.tolist()
    assert np.abs(np.array([r["relevance_score"] for r in response.results]) - expected[best]).max() < TOLERANCE


@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/score"])
def test_rerank_and_score_fuzzed(cross_encoder_server: ServerProcess, path: str) -> None:
    raw = httpx.get(f"{cross_encoder_server.root_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(pin_model(raw, cross_encoder_server.model))
    schema.config.update(base_url=cross_encoder_server.root_url)
    operation = schema[path]["POST"]
    answers: Counter[str] = Counter()
    failures = [text for mode in GenerationMode for text in fuzz(operation, mode, answers)]
    assert not failures, "\n\n".join(failures)
    assert answers["200"] and answers["400"], answers  # both accepted and refused bodies were tried
