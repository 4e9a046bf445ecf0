"""/openapi.json tells the truth: our error schema for the statuses we send, no 422, response schemas."""

from __future__ import annotations

from typing import Any

import httpx
import pytest


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
