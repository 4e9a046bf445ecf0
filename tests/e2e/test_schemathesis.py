"""Schemathesis in CI: a bounded run against the real server with the tiny model gives no 5xx and only responses
the OpenAPI document describes (status, content type, body schema)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.fuzz_schema import pin_model
from tests.e2e.server import ServerProcess, start_server

pytestmark = pytest.mark.e2e

EXAMPLES_PER_OPERATION = 30  # 10 operations: about 300 cases
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    # A short context keeps every generated request quick: longer max_tokens get their 400 at once.
    server = start_server(tiny_llama_dir, server_logs, "--max-model-len", "64", "--max-batch-size", "8")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed: ServerProcess) -> schemathesis.BaseSchema:
    raw = httpx.get(f"{fuzzed.root_url}/openapi.json", timeout=10).json()
    loaded = schemathesis.openapi.from_dict(pin_model(raw, fuzzed.model))
    loaded.config.update(base_url=fuzzed.root_url)
    return loaded


def test_no_server_errors_and_every_response_as_documented(api_schema: schemathesis.BaseSchema) -> None:
    failures: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
        )
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=30)

        try:
            run()
        except Exception as exc:  # collect every operation's failure, not just the first
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


# Generated bodies reach a 200 only now and then (most are, rightly, refused); these always do, streamed or not.
KNOWN_GOOD = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4, "n": 2, "logprobs": 1},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", list(KNOWN_GOOD))
def test_answers_match_their_documented_schema(
    api_schema: schemathesis.BaseSchema, fuzzed: ServerProcess, path: str, stream: bool
) -> None:
    operation = api_schema[path]["POST"]
    case = operation.Case(body={"model": fuzzed.model, "stream": stream, **KNOWN_GOOD[path]})
    response = case.call_and_validate(checks=CHECKS, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream" if stream else "application/json")
