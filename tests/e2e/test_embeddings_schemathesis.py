"""Schemathesis on /v1/embeddings of an embedding model (the tiny random BERT): no 5xx, only documented answers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from tests.e2e.fuzz_schema import pin_model
from tests.e2e.server import ServerProcess, start_server
from tests.e2e.test_schemathesis import CHECKS, TIMEOUT_S, fuzz


@pytest.fixture(scope="module")
def embedding_server(tiny_bert_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_bert_dir, server_logs, "--max-batch-size", "8")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embedding_schema(embedding_server: ServerProcess) -> schemathesis.BaseSchema:
    raw = httpx.get(f"{embedding_server.root_url}/openapi.json", timeout=10).json()
    # One known-good body runs first (schemathesis' explicit phase), so an accepted answer is validated against the
    # schema even when the generated bodies all happen to be refused (empty strings, unknown dimensions, ...).
    for path in ("/v1/embeddings", "/embeddings"):
        media = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        media["example"] = {"model": embedding_server.model, "input": ["a cat", "two dogs"], "priority": 3}
    loaded = schemathesis.openapi.from_dict(pin_model(raw, embedding_server.model))
    loaded.config.update(base_url=embedding_server.root_url)
    return loaded


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
def test_embeddings_fuzzed(embedding_schema: schemathesis.BaseSchema, path: str) -> None:
    operation = embedding_schema[path]["POST"]
    answers: Counter[str] = Counter()
    failures = [text for mode in GenerationMode for text in fuzz(operation, mode, answers)]
    assert not failures, "\n\n".join(failures)
    assert answers["200"] and answers["400"], answers  # both accepted and refused bodies were tried


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embeddings_answer_matches_its_documented_schema(
    embedding_schema: schemathesis.BaseSchema, embedding_server: ServerProcess, encoding_format: str
) -> None:
    operation = embedding_schema["/v1/embeddings"]["POST"]
    body: dict[str, Any] = {
        "model": embedding_server.model,
        "input": ["Hi", "there"],
        "encoding_format": encoding_format,
    }
    response = operation.Case(body=body).call_and_validate(checks=CHECKS, timeout=TIMEOUT_S)
    assert response.status_code == 200 and len(response.json()["data"]) == 2
