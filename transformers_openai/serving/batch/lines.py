"""A batch's lines: reading the input file (a bad line becomes an error line), and running one line through the
same handler an interactive request of its endpoint goes to, at the batch priority."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from transformers_openai.protocol import ChatCompletionRequest, CompletionRequest
from transformers_openai.protocol.batches import BatchError, BatchInputLine, BatchOutputLine, LineError, LineResponse
from transformers_openai.protocol.common import BATCH_PRIORITY
from transformers_openai.protocol.embeddings import EmbeddingRequest
from transformers_openai.protocol.responses import ResponsesRequest
from transformers_openai.serving.batch.store import NewLine
from transformers_openai.serving.disconnect import ClientDisconnected, WaitDisconnect
from transformers_openai.serving.errors import BadRequestError, OpenAIError, to_openai_error

logger = logging.getLogger(__name__)
MAX_FILE_ERRORS = 10  # line errors quoted in a failed batch's `errors`


class Creates(Protocol):
    """A handler as a batch line calls it (the chat, completions, embeddings and Responses handlers)."""

    def create(
        self, request: Any, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> Awaitable[Any]: ...


class EndpointHandlers(Protocol):
    """The served model's handlers (api.state.Handlers); a family the model cannot serve raises a 400."""

    @property
    def chat(self) -> Creates: ...

    @property
    def completions(self) -> Creates: ...

    @property
    def embeddings(self) -> Creates: ...

    @property
    def responses(self) -> Creates: ...


_REQUESTS: dict[str, tuple[type[BaseModel], Callable[[EndpointHandlers], Creates]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, lambda handlers: handlers.chat),
    "/v1/completions": (CompletionRequest, lambda handlers: handlers.completions),
    "/v1/embeddings": (EmbeddingRequest, lambda handlers: handlers.embeddings),
    "/v1/responses": (ResponsesRequest, lambda handlers: handlers.responses),
}


def handler_of(handlers: EndpointHandlers, endpoint: str) -> Creates:
    """The endpoint's handler; a 400 when the served model has none (checked when a batch is created)."""
    return _REQUESTS[endpoint][1](handlers)


@dataclass(frozen=True)
class ReadFile:
    """An input file as read: its lines, or why the whole file fails the batch."""

    lines: list[NewLine]
    errors: list[BatchError]


def read_input(data: bytes, endpoint: str, max_lines: int) -> ReadFile:
    """Splits an input file into lines to run and error lines. The whole file fails when it is not UTF-8 text, has
    no line or more than `max_lines`, or none of its lines is a request this batch can run."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return ReadFile([], [BatchError(code="invalid_file", message="the input file is not UTF-8 text (JSONL)")])
    raw = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not raw:
        return ReadFile([], [BatchError(code="empty_file", message="the input file has no lines")])
    if len(raw) > max_lines:
        message = f"the input file has {len(raw)} lines; a batch may hold at most {max_lines}"
        return ReadFile([], [BatchError(code="too_many_lines", message=message)])
    lines: list[NewLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, line in raw:
        custom_id, problem = _check_line(line, endpoint, seen)
        if problem is None:
            lines.append(NewLine(custom_id, json.dumps(json.loads(line)["body"])))
            continue
        code, message = problem
        errors.append(BatchError(code=code, message=message, line=number))
        lines.append(NewLine(custom_id, None, result=error_line(custom_id, code, f"line {number}: {message}")))
    if all(line.request is None for line in lines):
        return ReadFile([], errors[:MAX_FILE_ERRORS])
    return ReadFile(lines, [])


def _check_line(line: str, endpoint: str, seen: set[str]) -> tuple[str | None, tuple[str, str] | None]:
    """The line's custom_id (when it has one) and what is wrong with it, as (code, message), if anything."""
    try:
        value = json.loads(line)
    except ValueError:
        return None, ("invalid_json_line", "not valid JSON")
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    try:
        parsed = BatchInputLine.model_validate(value)
    except ValidationError as exc:
        return custom_id, ("invalid_request", _first_error(exc))
    if parsed.url != endpoint:
        return custom_id, ("mismatched_url", f"the line's url '{parsed.url}' is not the batch's endpoint '{endpoint}'")
    if parsed.custom_id in seen:
        return None, ("duplicate_custom_id", f"custom_id '{parsed.custom_id}' appears on an earlier line")
    seen.add(parsed.custom_id)
    return parsed.custom_id, None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """An error-file line for a line that never ran."""
    line = BatchOutputLine(id=_line_id(), custom_id=custom_id, error=LineError(code=code, message=message))
    return line.model_dump_json()


def response_line(custom_id: str, request_id: str, status_code: int, body: dict[str, Any]) -> str:
    response = LineResponse(status_code=status_code, request_id=request_id, body=body)
    return BatchOutputLine(id=_line_id(), custom_id=custom_id, response=response).model_dump_json()


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


class Retry(Exception):
    """The server could not take the line now (at capacity, loading, stopping): run it again later."""


async def run_line(
    handlers: EndpointHandlers, endpoint: str, custom_id: str, body: str, wait_cancel: WaitDisconnect
) -> tuple[str, bool]:
    """Runs one line: its result line and whether it is an error (a 4xx or 5xx answer). `wait_cancel` returns when
    the batch is cancelled: the line's engine work is aborted (ClientDisconnected)."""
    request_id = uuid.uuid4().hex
    model, handler_for = _REQUESTS[endpoint]
    try:
        request = _request(model, json.loads(body))
        result = await handler_for(handlers).create(request, wait_cancel, request_id)
        return response_line(custom_id, request_id, 200, result.model_dump()), False
    except OpenAIError as exc:
        error = exc
    except ClientDisconnected:
        raise  # the batch was cancelled: the line stays unanswered
    except Exception as exc:  # the engine's fault: an error line, the batch goes on
        logger.warning("batch line %s failed: %s", custom_id, exc)
        error = to_openai_error(exc)
    if error.status_code in (429, 503):
        raise Retry(error.message)
    return response_line(custom_id, request_id, error.status_code, error.body().model_dump()), True


def _request(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """The line's body as its endpoint's request, at the batch priority (below every interactive request)."""
    if body.get("stream"):
        raise BadRequestError("a batch line cannot stream: 'stream' must be false", param="stream")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise BadRequestError(_first_error(exc), param=param, code="invalid_value") from None
    return request.model_copy(update={"priority": BATCH_PRIORITY})
