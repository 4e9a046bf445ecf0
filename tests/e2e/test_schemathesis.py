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
from hypothesis import strategies as st
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

EXAMPLES = 30  # per operation and generation mode: about 1,000 requests in all
# An operation also served under /v1 is the same route function: a few cases show it is wired and answers as
# documented, the /v1 twin gets the full run.
TWIN_EXAMPLES = 5
TIMEOUT_S = 30  # per request: a hang is a failure, not a stuck CI job
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(
    tiny_llama_dir: Path, server_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # A short context keeps every generated request quick: longer max_tokens get their 400 at once. The Batch API's
    # files go to a folder of the test's own.
    data = str(tmp_path_factory.mktemp("fuzz-data"))
    args = ("--max-model-len", "64", "--max-batch-size", "8", "--data-dir", data)
    server = start_server(tiny_llama_dir, server_logs, *args)
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
    operation: schemathesis.APIOperation[Any, Any, Any, Any],
    mode: GenerationMode,
    answers: Counter[str],
    examples: int = EXAMPLES,
) -> list[str]:
    """Up to `examples` cases of one operation; the distinct failures found."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
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
    versioned = {(operation.method, operation.path) for operation in operations if operation.path.startswith("/v1/")}
    for operation in operations:
        twin = (operation.method, "/v1" + operation.path) in versioned
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for text in fuzz(operation, mode, answers, TWIN_EXAMPLES if twin else EXAMPLES):
                failures.append(f"=== {operation.label}, {mode.value} cases ===\n{text}")
    tally = f"{sum(answers.values())} requests, {len(operations)} operations, answers {dict(sorted(answers.items()))}"
    print(tally)
    if failures:
        pytest.fail(f"{len(failures)} distinct failures ({tally}):\n\n" + "\n\n".join(failures), pytrace=False)


# Generated bodies reach a 200 only now and then (most are, rightly, refused); these always do, streamed or not.
KNOWN_GOOD: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    "chat, reasoning fields": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "They greet me."},
                {"role": "user", "content": "Bye"},
            ],
            "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "low",
            "include_reasoning": False,
            "separate_reasoning": False,
        },
    ),
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "n": 2, "logprobs": 1}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
    "anthropic messages": (
        "/v1/messages",
        {
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 4,
        },
    ),
    "responses, reasoning": (
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "A greeting."}]},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
            ],
            "max_output_tokens": 4,
            "reasoning": {"effort": "low", "summary": "auto"},
        },
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("name", list(KNOWN_GOOD))
def test_answers_match_their_documented_schema(
    api_schema: schemathesis.BaseSchema, fuzzed: ServerProcess, name: str, stream: bool
) -> None:
    path, body = KNOWN_GOOD[name]
    operation = api_schema[path]["POST"]
    case = operation.Case(body={"model": fuzzed.model, "stream": stream, **body})
    response = case.call_and_validate(checks=CHECKS, timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream" if stream else "application/json")


# The fields of reasoning models and images, fuzzed where schema-driven generation seldom goes: any JSON value, or a
# near-valid one, in each of them on an otherwise good request. A few dozen requests per endpoint, a few seconds.
NEW_FIELD_EXAMPLES = 40
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_EFFORTS = st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "", "HIGH"])
_URLS = st.sampled_from(
    [
        "",
        "data:,",
        "data:image/png;base64,",
        "data:image/png;base64,iVBORw0KGgo=",
        "data:image/png;base64,@@",
        "http://127.0.0.1:1/x.png",
        "http://169.254.169.254/",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "ftp://example.com/x.png",
    ]
) | st.text(max_size=20)
_IMAGE_PART = st.fixed_dictionaries(
    {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _URLS}) | _URLS | _JSON}
)
_CHAT_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "thinking", "reasoning_effort", "messages", "x"]), _JSON | _EFFORTS
        )
        | _JSON,
        "reasoning_effort": _EFFORTS | _JSON,
        "include_reasoning": st.booleans() | _JSON,
        "separate_reasoning": st.booleans() | _JSON,
        "stream_reasoning": st.booleans() | _JSON,
        "stream": st.booleans(),
        "messages": st.lists(_IMAGE_PART | st.just({"type": "text", "text": "Hi"}), min_size=1, max_size=3).map(
            lambda parts: [{"role": "user", "content": parts}]
        ),
    },
)
_THOUGHT = st.fixed_dictionaries(
    {"type": st.just("reasoning")},
    optional={
        "summary": st.lists(_JSON, max_size=2),
        "content": st.lists(st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": st.text(max_size=12)}))
        | _JSON,
        "encrypted_content": _JSON,
    },
)
_INPUT_IMAGE = st.fixed_dictionaries(
    {"type": st.just("input_image")},
    optional={"image_url": _URLS | _JSON, "file_id": _JSON, "detail": st.sampled_from(["auto", "low", "original"])},
)
_RESPONSES_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "reasoning": st.fixed_dictionaries({}, optional={"effort": _EFFORTS | _JSON, "summary": _JSON}) | _JSON,
        "stream": st.booleans(),
        "input": st.lists(
            st.sampled_from([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
            | _THOUGHT
            | st.lists(_INPUT_IMAGE, min_size=1, max_size=2).map(lambda parts: {"role": "user", "content": parts}),
            min_size=1,
            max_size=4,
        ),
    },
)
_NEW_FIELDS = {
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        _CHAT_FIELDS,
    ),
    "/v1/responses": ({"input": "Hi", "max_output_tokens": 2}, _RESPONSES_FIELDS),
}


@pytest.mark.parametrize("path", list(_NEW_FIELDS))
def test_reasoning_and_image_fields_get_no_server_error(fuzzed: ServerProcess, path: str) -> None:
    base, fields = _NEW_FIELDS[path]
    answers: Counter[int] = Counter()

    @given(extra=fields)
    @settings(
        max_examples=NEW_FIELD_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def run(extra: dict[str, Any]) -> None:
        body = {"model": fuzzed.model, **base, **extra}
        response = httpx.post(fuzzed.root_url + path, json=body, timeout=TIMEOUT_S)
        answers[response.status_code] += 1
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], error
        elif body.get("stream"):
            assert "data:" in response.text and '"type":"server_error"' not in response.text, response.text

    run()
    print(path, dict(answers))
    assert answers[200] > 0 and sum(n for status, n in answers.items() if status >= 400) > 0, answers
