"""/v1/files: uploads for batches (JSONL) and the batches' output files, stored on disk."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from transformers_openai.protocol.batches import FileDeleted, FileList, FileObject
from transformers_openai.serving.batch.paging import check_limit, page_fields
from transformers_openai.serving.batch.store import BatchStore, now
from transformers_openai.serving.errors import BadRequestError, NotFoundError, PayloadTooLargeError

CHUNK_BYTES = 1024 * 1024
MAX_LIST = 10_000  # OpenAI's largest `limit` of GET /v1/files


@dataclass(frozen=True)
class BatchLimits:
    max_file_bytes: int
    max_lines: int
    max_files: int
    concurrency: int


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileHandler:
    """Stores, lists, reads and deletes files; each blocking step runs in a worker thread."""

    def __init__(self, store: BatchStore, limits: BatchLimits) -> None:
        self.store = store
        self.limits = limits

    async def create(self, upload: BinaryIO, filename: str, purpose: str, owner: str | None) -> FileObject:
        if purpose != "batch":
            raise BadRequestError(
                f"purpose '{purpose}' is not supported: this server stores files for the Batch API only "
                "(purpose 'batch')",
                param="purpose",
                code="invalid_value",
            )
        if not filename.endswith(".jsonl"):
            raise BadRequestError("a batch input file must be JSONL, named *.jsonl", param="file", code="invalid_file")
        return await asyncio.to_thread(self._store, upload, filename, owner)

    def _store(self, upload: BinaryIO, filename: str, owner: str | None) -> FileObject:
        if self.store.count_files() >= self.limits.max_files:
            raise BadRequestError(
                f"this server stores at most {self.limits.max_files} files: delete some first",
                param="file",
                code="file_limit_reached",
            )
        upload.seek(0, 2)
        size = upload.tell()
        upload.seek(0)
        if size > self.limits.max_file_bytes:
            raise PayloadTooLargeError(f"the file has {size} bytes; at most {self.limits.max_file_bytes} are accepted")
        if size == 0:
            raise BadRequestError("the file is empty", param="file", code="invalid_file")
        file = FileObject(id=new_file_id(), bytes=size, created_at=now(), filename=filename, purpose="batch")
        self.store.add_file(file, owner, iter(lambda: upload.read(CHUNK_BYTES), b""))
        return file

    async def get(self, file_id: str, owner: str | None) -> FileObject:
        file = await asyncio.to_thread(self.store.get_file, file_id, owner)
        if file is None:
            raise NotFoundError(f"no file with id '{file_id}'", param="file_id", code="file_not_found")
        return file

    async def list(self, owner: str | None, purpose: str | None, after: str | None, limit: int) -> FileList:
        check_limit(limit, MAX_LIST)
        files = await asyncio.to_thread(self.store.list_files, owner, purpose, after, limit + 1)
        return FileList(**page_fields(files, limit))

    async def content(self, file_id: str, owner: str | None) -> BinaryIO:
        """The file's bytes, opened (a route streams them with `read_chunks`, which closes it)."""
        await self.get(file_id, owner)
        try:
            return await asyncio.to_thread(self.store.file_path(file_id).open, "rb")
        except FileNotFoundError:  # deleted meanwhile
            raise NotFoundError(f"no file with id '{file_id}'", param="file_id", code="file_not_found") from None

    async def delete(self, file_id: str, owner: str | None) -> FileDeleted:
        if not await asyncio.to_thread(self.store.delete_file, file_id, owner):
            raise NotFoundError(f"no file with id '{file_id}'", param="file_id", code="file_not_found")
        return FileDeleted(id=file_id)


def read_chunks(source: BinaryIO) -> Iterator[bytes]:
    """The bytes of an open file, a chunk at a time (Starlette iterates it in a worker thread), then closes it."""
    with source:
        yield from iter(lambda: source.read(CHUNK_BYTES), b"")
