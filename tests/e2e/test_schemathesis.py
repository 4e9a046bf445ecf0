"""Schemathesis in CI: a bounded run against the real server with the tiny model gives no 5xx and only responses
the OpenAPI document describes (status, content type, body schema).

Every operation of /openapi.json gets schema-valid (positive) and schema-breaking (negative) cases, `model` pinned
to the served name (tests/e2e/fuzz_schema.py). schemathesis's pytest plugin does not run on pytest 9.2 (it reads
`Function._nodeid`), so the cases come from its documented Python API, `APIOperation.as_strategy`, driven by
hypothesis directly. scripts/fuzz_api.py is the big version of this run (`st run`, thousands of cases).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

from tests.e2e.fuzz_schema import pin_model
from tests.e2e.server import ServerProcess, start_server

EXAMPLES = 30  # per operation and generation mode: about 300 requests in all, a few seconds
TIMEOUT_S = 30  # per request: a hang is a failure, not a stuck CI job
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
    loaded.config.output.sanitization.update(enabled=False)  # else curl lines show max_tokens as "[Filtered]"
    return loaded


def describe(exc: BaseException) -> list[str]:
    """One text per distinct failure: the checks that failed, the response and a curl line (or what was raised)."""
    if isinstance(exc, FailureGroup):
        return [str(exc).strip()]
    inner = getattr(exc, "exceptions", None)  # hypothesis groups distinct failures of one test
    if inner:
        return [text for each in inner for text in describe(each)]
    return ["\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])]).strip()]


def fuzz(
    operation: schemathesis.APIOperation[Any, Any, Any, Any], mode: GenerationMode, answers: Counter[str]
) -> list[str]:
    """Up to EXAMPLES cases of one operation; the distinct failures found."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    def run(case: schemathesis.Case[Any]) -> None:
        try:
            response = case.call(timeout=TIMEOUT_S)
        except Exception:  # no answer within TIMEOUT_S, or the connection dropped; the note has the curl line
            answers["no answer"] += 1
            raise
        answers[str(response.status_code)] += 1
        case.validate_response(response, checks=CHECKS)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        return []  # nothing to break: an operation without parameters or body has no negative cases
    except (Exception, FailureGroup) as exc:  # FailureGroup is a BaseExceptionGroup, not an Exception
        return describe(exc)
    return []


def test_no_server_errors_and_every_response_as_documented(api_schema: schemathesis.BaseSchema) -> None:
    operations = []
    for result in api_schema.get_all_operations():
        assert isinstance(result, Ok), result  # an operation its schema cannot describe
        operations.append(result.ok())
    assert len(operations) >= 10, [operation.label for operation in operations]
    answers: Counter[str] = Counter()
    failures: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for text in fuzz(operation, mode, answers):
                failures.append(f"=== {operation.label}, {mode.value} cases ===\n{text}")
    tally = f"{sum(answers.values())} requests, {len(operations)} operations, answers {dict(sorted(answers.items()))}"
    print(tally)
    if failures:
        pytest.fail(f"{len(failures)} distinct failures ({tally}):\n\n" + "\n\n".join(failures), pytrace=False)


# Generated bodies reach a 200 only now and then (most are, rightly, refused); these always do, streamed or not.
KNOWN_GOOD: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4, "n": 2, "logprobs": 1},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", list(KNOWN_GOOD))
def test_answers_match_their_documented_schema(
    api_schema: schemathesis.BaseSchema, fuzzed: ServerProcess, path: str, stream: bool
) -> None:
    operation = api_schema[path]["POST"]
    case = operation.Case(body={"model": fuzzed.model, "stream": stream, **KNOWN_GOOD[path]})
    response = case.call_and_validate(checks=CHECKS, timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream" if stream else "application/json")
