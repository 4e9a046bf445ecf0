"""The wire protocol of the Batch API: /v1/files and /v1/batches, and the lines of a batch's input and output files."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from transformers_openai.protocol.base import Strict, Text

# The endpoints a batch may run, each line's `url` equal to its batch's.
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
BATCH_ENDPOINTS: tuple[str, ...] = BatchEndpoint.__args__  # type: ignore[attr-defined]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FilePurpose = Literal["batch", "batch_output"]
MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreateRequest(Strict):
    input_file_id: Text
    endpoint: BatchEndpoint
    completion_window: Literal["24h"] = Field(description="Only '24h', as OpenAI")
    metadata: dict[Text, Text] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE_CHARS} characters")
        return value


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based, in the input file


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchInputLine(BaseModel):
    """One line of a batch's input file (read leniently: what is wrong with it becomes that line's error)."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str | None
    response: LineResponse | None = None
    error: LineError | None = None
