"""/v1/batches: create, get, list and cancel batches; the BatchRunner does their work."""

from __future__ import annotations

import asyncio
import uuid

from transformers_openai.protocol.batches import Batch, BatchCreateRequest, BatchList, RequestCounts
from transformers_openai.serving.batch.lines import EndpointHandlers, handler_of
from transformers_openai.serving.batch.paging import check_limit, page_fields
from transformers_openai.serving.batch.runner import BatchRunner
from transformers_openai.serving.batch.store import BatchStore, now
from transformers_openai.serving.errors import BadRequestError, NotFoundError

COMPLETION_WINDOW_S = 24 * 3600
MAX_LIST = 100  # OpenAI's largest `limit` of GET /v1/batches


class BatchHandler:
    def __init__(self, store: BatchStore, runner: BatchRunner) -> None:
        self.store = store
        self.runner = runner

    async def create(self, request: BatchCreateRequest, owner: str | None, handlers: EndpointHandlers) -> Batch:
        """Checks the input file and that the served model answers the endpoint (a 400 otherwise), then queues the
        batch: its lines are read and run in the background."""
        handler_of(handlers, request.endpoint)
        file = await asyncio.to_thread(self.store.get_file, request.input_file_id, owner)
        if file is None:
            message = f"no file with id '{request.input_file_id}'"
            raise NotFoundError(message, param="input_file_id", code="file_not_found")
        if file.purpose != "batch":
            message = f"the file '{file.id}' has purpose '{file.purpose}'; a batch reads a file of purpose 'batch'"
            raise BadRequestError(message, param="input_file_id", code="invalid_value")
        created = now()
        batch = Batch(
            id=f"batch_{uuid.uuid4().hex}",
            endpoint=request.endpoint,
            input_file_id=file.id,
            completion_window=request.completion_window,
            status="validating",
            created_at=created,
            expires_at=created + COMPLETION_WINDOW_S,
            metadata=request.metadata,
            request_counts=RequestCounts(),
        )
        await asyncio.to_thread(self.store.add_batch, batch, owner)
        self.runner.wake()
        return batch

    async def get(self, batch_id: str, owner: str | None) -> Batch:
        batch = await asyncio.to_thread(self.store.get_batch, batch_id, owner)
        if batch is None:
            raise NotFoundError(f"no batch with id '{batch_id}'", param="batch_id", code="batch_not_found")
        return batch

    async def list(self, owner: str | None, after: str | None, limit: int) -> BatchList:
        check_limit(limit, MAX_LIST)
        batches = await asyncio.to_thread(self.store.list_batches, owner, after, limit + 1)
        return BatchList(**page_fields(batches, limit))

    async def cancel(self, batch_id: str, owner: str | None) -> Batch:
        """Moves a running batch to cancelling (the runner stops its lines and finishes it as cancelled); a batch
        already finished is a 400, as OpenAI's."""
        batch = await self.get(batch_id, owner)
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.status not in ("validating", "in_progress"):
            message = f"the batch is {batch.status}: only a validating or in-progress batch can be cancelled"
            raise BadRequestError(message, param="batch_id", code="invalid_state")
        batch.status, batch.cancelling_at = "cancelling", now()
        if not await asyncio.to_thread(self.store.update_batch, batch, ("validating", "in_progress")):
            return await self.cancel(batch_id, owner)  # it moved on meanwhile: answer for its new state
        self.runner.cancel(batch_id)
        return batch
