"""The one error hierarchy of the server and its mapping from engine and validation failures."""

from __future__ import annotations

from transformers_openai.engine.errors import (
    DuplicateRequestId,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    TooManySequences,
)
from transformers_openai.protocol import ErrorBody, ErrorResponse
from transformers_openai.protocol.messages import AnthropicErrorBody, AnthropicErrorResponse

# Anthropic's error types by status, for the Messages routes (its API answers 529 where this server says 503).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class OpenAIError(Exception):
    """An error the client sees, in OpenAI's shape, with its HTTP status."""

    status_code = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        # Messages may quote client input; keep them encodable whatever it held (e.g. lone surrogates).
        message = _encodable(message)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else _encodable(param)
        if code is not None:
            self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def anthropic_body(self) -> AnthropicErrorResponse:
        """The same error in Anthropic's shape (the Messages routes')."""
        kind = _ANTHROPIC_TYPES.get(
            self.status_code, "api_error" if self.status_code >= 500 else "invalid_request_error"
        )
        return AnthropicErrorResponse(error=AnthropicErrorBody(type=kind, message=self.message))

    def headers(self) -> dict[str, str]:
        return {}


class BadRequestError(OpenAIError):
    status_code = 400
    type = "invalid_request_error"


class AuthenticationError(OpenAIError):
    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFoundError(OpenAIError):
    status_code = 404
    type = "invalid_request_error"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class RequestTimeoutError(OpenAIError):
    status_code = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLargeError(OpenAIError):
    status_code = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimitError(OpenAIError):
    status_code = 429
    type = "rate_limit_error"  # kept apart from OpenAI's quota errors by the code below
    code = "server_overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServiceUnavailableError(OpenAIError):
    status_code = 503
    type = "service_unavailable"


class ModelUnavailableError(ServiceUnavailableError):
    """A model named by the request cannot be loaded now (no room in the memory budget, or its load ran past the
    wait): try again later."""

    code = "model_unavailable"

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message, param="model")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class InternalServerError(OpenAIError):
    status_code = 500
    type = "server_error"


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def to_openai_error(exc: BaseException) -> OpenAIError:
    """The one mapping from any failure to what the client is told."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return RateLimitError(str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, TooManySequences):
        return BadRequestError(f"{exc}; lower n or send fewer prompts", param="n", code="too_many_sequences")
    if isinstance(exc, DuplicateRequestId):
        return BadRequestError(f"{exc}; use a fresh X-Request-Id", code="duplicate_request_id")
    if isinstance(exc, EngineStopped):
        return ServiceUnavailableError(str(exc))
    if isinstance(exc, EngineError):
        return InternalServerError(str(exc))
    return InternalServerError(f"internal error: {type(exc).__name__}")
