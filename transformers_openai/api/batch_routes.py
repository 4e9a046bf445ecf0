"""/v1/files and /v1/batches: OpenAI's Batch API, with files and batches kept under --data-dir."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from transformers_openai.api.openapi import error_responses
from transformers_openai.api.response_routes import owner_of_request
from transformers_openai.protocol.batches import (
    Batch,
    BatchCreateRequest,
    BatchList,
    FileDeleted,
    FileList,
    FileObject,
)
from transformers_openai.serving.batch import BatchApi
from transformers_openai.serving.batch.files import read_chunks

_ERRORS = error_responses(400, 401, 404, 408, 413, 429, 503)
_CONTENT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string"}}}, "description": "The file"},
    **_ERRORS,
}


def _api(request: Request) -> BatchApi:
    api: BatchApi = request.app.state.batch_api
    return api


def build_batch_router() -> APIRouter:
    router = APIRouter()

    @router.post("/files", responses=_ERRORS)
    async def create_file(
        request: Request,
        file: Annotated[UploadFile, File(description="The batch's input: JSONL, one request a line")],
        purpose: Annotated[str, Form(description="'batch'")],
    ) -> FileObject:
        return await _api(request).files.create(file.file, file.filename or "", purpose, owner_of_request(request))

    @router.get("/files", responses=_ERRORS)
    async def list_files(
        request: Request, purpose: str | None = None, after: str | None = None, limit: int = Query(10_000)
    ) -> FileList:
        return await _api(request).files.list(owner_of_request(request), purpose, after, limit)

    @router.get("/files/{file_id}", responses=_ERRORS)
    async def get_file(file_id: str, request: Request) -> FileObject:
        return await _api(request).files.get(file_id, owner_of_request(request))

    @router.get("/files/{file_id}/content", response_class=StreamingResponse, responses=_CONTENT)
    async def file_content(file_id: str, request: Request) -> StreamingResponse:
        source = await _api(request).files.content(file_id, owner_of_request(request))
        return StreamingResponse(read_chunks(source), media_type="application/octet-stream")  # read in a thread

    @router.delete("/files/{file_id}", responses=_ERRORS)
    async def delete_file(file_id: str, request: Request) -> FileDeleted:
        return await _api(request).files.delete(file_id, owner_of_request(request))

    @router.post("/batches", responses=_ERRORS)
    async def create_batch(body: BatchCreateRequest, request: Request) -> Batch:
        handlers = request.app.state.batch_handlers()
        return await _api(request).batches.create(body, owner_of_request(request), handlers)

    @router.get("/batches", responses=_ERRORS)
    async def list_batches(request: Request, after: str | None = None, limit: int = Query(20)) -> BatchList:
        return await _api(request).batches.list(owner_of_request(request), after, limit)

    @router.get("/batches/{batch_id}", responses=_ERRORS)
    async def get_batch(batch_id: str, request: Request) -> Batch:
        return await _api(request).batches.get(batch_id, owner_of_request(request))

    @router.post("/batches/{batch_id}/cancel", responses=_ERRORS)
    async def cancel_batch(batch_id: str, request: Request) -> Batch:
        return await _api(request).batches.cancel(batch_id, owner_of_request(request))

    return router
