"""/openapi.json tells the truth: our error schema for the statuses we send, no 422, response schemas."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.app.support import MODEL
from transformers_openai.settings import Settings


@pytest.fixture
async def document(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, item in document["paths"].items() for method, op in item.items()]


async def test_no_422_anywhere(document: dict[str, Any]) -> None:
    for path, method, op in operations(document):
        assert "422" not in op["responses"], (method, path)
    assert not {"HTTPValidationError", "ValidationError"} & set(document["components"]["schemas"])


async def test_generation_routes_document_their_errors_and_their_200(document: dict[str, Any]) -> None:
    expected = {"/v1/chat/completions": "ChatCompletionResponse", "/v1/completions": "CompletionResponse"}
    for path, model in expected.items():
        for route in (path, path.removeprefix("/v1")):
            responses = document["paths"][route]["post"]["responses"]
            ok = responses["200"]["content"]
            assert ok["application/json"]["schema"]["$ref"].endswith(f"/{model}")
            assert "text/event-stream" in ok
            for status in ("400", "401", "404", "413", "429", "503"):
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema["$ref"].endswith("/ErrorResponse"), (route, status)


async def test_every_operation_has_a_200_schema_and_a_unique_id(document: dict[str, Any]) -> None:
    ids = [op["operationId"] for _, _, op in operations(document)]
    assert len(ids) == len(set(ids))
    for path, method, op in operations(document):
        assert method != "head", path  # HEAD is answered, documented once as GET
        content = op["responses"]["200"]["content"]
        assert any(media.get("schema") for media in content.values()), (method, path)


async def test_every_operation_documents_our_errors(document: dict[str, Any]) -> None:
    for path, method, op in operations(document):
        for status in ("400", "401", "404", "413", "429", "503"):
            schema = op["responses"][status]["content"]["application/json"]["schema"]
            # Anthropic's Messages routes answer in Anthropic's shape
            shape = "/AnthropicErrorResponse" if path.removeprefix("/v1").startswith("/messages") else "/ErrorResponse"
            assert schema["$ref"].endswith(shape), (method, path, status)
    error = document["components"]["schemas"]["ErrorBody"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}


async def test_what_the_get_routes_answer_is_documented(client: httpx.AsyncClient, document: dict[str, Any]) -> None:
    for path, method, op in operations(document):
        if method != "get":
            continue
        for url in {path.replace("{model_id}", MODEL), path.replace("{model_id}", "no-such-model")}:
            response = await client.get(url)
            documented = op["responses"].get(str(response.status_code))
            assert documented is not None, (url, response.status_code)
            media = response.headers["content-type"].split(";")[0]
            assert media in documented["content"], (url, media, list(documented["content"]))


async def test_body_checks_on_get_routes_are_documented(client: httpx.AsyncClient, document: dict[str, Any]) -> None:
    too_big = await client.request("GET", "/v1/models", content=b"x" * (Settings(model=MODEL).max_request_bytes + 1))
    not_utf8 = await client.request("GET", "/health", content="{}".encode("utf-16"))
    assert (too_big.status_code, not_utf8.status_code) == (413, 400)
    assert "413" in document["paths"]["/v1/models"]["get"]["responses"]
    assert "400" in document["paths"]["/health"]["get"]["responses"]
