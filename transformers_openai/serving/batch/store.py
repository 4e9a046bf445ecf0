"""The Batch API's state on disk: files' metadata, batches and each line's result in SQLite, files' bytes beside it.

Every method blocks (SQLite, the file system): callers run them off the event loop (`asyncio.to_thread`). One
connection behind a lock serves every thread; each write is one transaction, so a line's result and its batch's
counts change together, and a server killed at any point restarts from a consistent state.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from transformers_openai.protocol.batches import Batch, FileObject, RequestCounts

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT, status TEXT NOT NULL,
    body TEXT NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, request TEXT, done INTEGER NOT NULL DEFAULT 0,
    is_error INTEGER NOT NULL DEFAULT 0, result TEXT, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done, idx);
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class PendingLine:
    batch_id: str
    index: int
    custom_id: str
    request: str  # the line's body, as JSON


@dataclass(frozen=True)
class NewLine:
    """A line of an input file as validation left it: a request to run, or an error line already (`result`)."""

    custom_id: str | None
    request: str | None
    result: str | None = None


class BatchStore:
    """Files and batches under `root` (`batches.sqlite3` and `files/`), made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @property
    def exists(self) -> bool:
        """Whether anything was ever stored (a server that never saw a batch leaves no trace)."""
        return (self.root / "batches.sqlite3").exists()

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._db is None:
                self._db = self._open()
            with self._db:  # one transaction: committed on success, rolled back on an exception
                yield self._db

    def _open(self) -> sqlite3.Connection:
        (self.root / "files").mkdir(parents=True, exist_ok=True, mode=0o700)
        db = sqlite3.connect(self.root / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # durable against a killed process (not a lost machine)
        db.executescript(_SCHEMA)
        db.isolation_level = "DEFERRED"
        return db

    # -- files
    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def count_files(self) -> int:
        with self._tx() as db:
            return int(db.execute("SELECT COUNT(*) FROM files").fetchone()[0])

    def write_bytes(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Writes a file's bytes (under a temporary name first, then renamed); returns how many."""
        with self._tx():
            pass  # the folders exist once the database does
        path = self.file_path(file_id)
        temporary = path.with_suffix(".part")
        size = 0
        with temporary.open("wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        temporary.replace(path)
        return size

    def add_file(self, file: FileObject, owner: str | None, chunks: Iterable[bytes]) -> None:
        self.write_bytes(file.id, chunks)
        with self._tx() as db:
            db.execute("INSERT INTO files (id, owner, body) VALUES (?, ?, ?)", (file.id, owner, file.model_dump_json()))

    def get_file(self, file_id: str, owner: str | None) -> FileObject | None:
        if not self.exists:  # reading makes nothing on disk
            return None
        with self._tx() as db:
            row = db.execute("SELECT body FROM files WHERE id = ? AND owner IS ?", (file_id, owner)).fetchone()
        return None if row is None else FileObject.model_validate_json(row[0])

    def list_files(self, owner: str | None, purpose: str | None, after: str | None, limit: int) -> list[FileObject]:
        """Newest first, after the file `after` (a cursor), at most `limit`."""
        if not self.exists:  # reading makes nothing on disk
            return []
        with self._tx() as db:
            rows = db.execute(
                "SELECT body FROM files WHERE owner IS ? AND seq < COALESCE((SELECT seq FROM files WHERE id = ?), "
                "9223372036854775807) ORDER BY seq DESC",
                (owner, after),
            )
            files = (FileObject.model_validate_json(body) for (body,) in rows)
            return list(islice((file for file in files if purpose in (None, file.purpose)), limit))

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        if not self.exists:  # reading makes nothing on disk
            return False
        with self._tx() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ? AND owner IS ?", (file_id, owner)).rowcount > 0
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return deleted

    # -- batches
    def add_batch(self, batch: Batch, owner: str | None) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, owner, status, body) VALUES (?, ?, ?, ?)",
                (batch.id, owner, batch.status, batch.model_dump_json()),
            )

    def get_batch(self, batch_id: str, owner: str | None = None, any_owner: bool = False) -> Batch | None:
        if not self.exists:  # reading makes nothing on disk
            return None
        with self._tx() as db:
            query = "SELECT body, completed, failed FROM batches WHERE id = ?"
            args: tuple[str | None, ...] = (batch_id,)
            if not any_owner:
                query, args = query + " AND owner IS ?", (batch_id, owner)
            row = db.execute(query, args).fetchone()
        return None if row is None else _batch(row)

    def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[Batch]:
        if not self.exists:  # reading makes nothing on disk
            return []
        with self._tx() as db:
            rows = db.execute(
                "SELECT body, completed, failed FROM batches WHERE owner IS ? AND seq < COALESCE((SELECT seq FROM "
                "batches WHERE id = ?), 9223372036854775807) ORDER BY seq DESC LIMIT ?",
                (owner, after, limit),
            ).fetchall()
        return [_batch(row) for row in rows]

    def active_batches(self) -> list[Batch]:
        """The batches with work left, oldest first."""
        with self._tx() as db:
            rows = db.execute(
                f"SELECT body, completed, failed FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) "
                "ORDER BY seq",
                ACTIVE,
            ).fetchall()
        return [_batch(row) for row in rows]

    def update_batch(self, batch: Batch, only_from: Iterable[str] | None = None) -> bool:
        """Saves the batch's status and fields (not its counts); with `only_from`, only while its stored status is
        one of those (False otherwise: e.g. a cancel came first)."""
        with self._tx() as db:
            return _update(db, batch, only_from)

    def start_lines(self, batch: Batch, lines: list[NewLine]) -> bool:
        """Records a validated input file's lines and moves the batch to in_progress, in one transaction; the error
        lines count as failed at once. False (nothing recorded) if the batch is no longer validating (cancelled)."""
        failed = sum(line.result is not None for line in lines)
        with self._tx() as db:
            if not _update(db, batch, ("validating",)):
                return False
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch.id,))  # a validation cut short before
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, request, done, is_error, result) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        batch.id,
                        i,
                        line.custom_id,
                        line.request,
                        int(line.result is not None),
                        int(line.result is not None),
                        line.result,
                    )
                    for i, line in enumerate(lines)
                ),
            )
            db.execute("UPDATE batches SET completed = 0, failed = ? WHERE id = ?", (failed, batch.id))
            return True

    def pending_lines(self, batch_id: str, after: int, limit: int) -> list[PendingLine]:
        """Lines not answered yet, past index `after`, in file order."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT idx, custom_id, request FROM lines WHERE batch_id = ? AND done = 0 AND idx > ? "
                "ORDER BY idx LIMIT ?",
                (batch_id, after, limit),
            ).fetchall()
        return [PendingLine(batch_id, idx, custom_id, request) for idx, custom_id, request in rows]

    def has_pending(self, batch_id: str) -> bool:
        with self._tx() as db:
            return (
                db.execute("SELECT 1 FROM lines WHERE batch_id = ? AND done = 0 LIMIT 1", (batch_id,)).fetchone()
                is not None
            )

    def record(self, line: PendingLine, result: str, is_error: bool) -> bool:
        """A line's result and its batch's count, in one transaction; False if the line was answered already."""
        with self._tx() as db:
            changed = db.execute(
                "UPDATE lines SET done = 1, is_error = ?, result = ? WHERE batch_id = ? AND idx = ? AND done = 0",
                (int(is_error), result, line.batch_id, line.index),
            ).rowcount
            if changed:
                column = "failed" if is_error else "completed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (line.batch_id,))
            return changed > 0

    def results(self, batch_id: str, errors: bool) -> Iterator[str]:
        """The answered lines' result lines (outputs, or errors), in file order."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT result FROM lines WHERE batch_id = ? AND done = 1 AND is_error = ? ORDER BY idx",
                (batch_id, int(errors)),
            ).fetchall()
        return (result for (result,) in rows)

    def unanswered(self, batch_id: str) -> list[tuple[int, str | None]]:
        with self._tx() as db:
            rows = db.execute(
                "SELECT idx, custom_id FROM lines WHERE batch_id = ? AND done = 0 ORDER BY idx", (batch_id,)
            ).fetchall()
        return [(idx, custom_id) for idx, custom_id in rows]

    def finish(self, batch: Batch, files: list[FileObject]) -> None:
        """Records a batch's output files and its final state in one transaction (their bytes are written), and
        drops its lines (their results are in the files now)."""
        with self._tx() as db:
            (owner,) = db.execute("SELECT owner FROM batches WHERE id = ?", (batch.id,)).fetchone()
            for file in files:
                db.execute(
                    "INSERT INTO files (id, owner, body) VALUES (?, ?, ?)", (file.id, owner, file.model_dump_json())
                )
            _update(db, batch, None)
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch.id,))


def _batch(row: tuple[str, int, int]) -> Batch:
    body, completed, failed = row
    batch = Batch.model_validate_json(body)
    total = batch.request_counts.total
    batch.request_counts = RequestCounts(total=total, completed=completed, failed=failed)
    return batch


def _update(db: sqlite3.Connection, batch: Batch, only_from: Iterable[str] | None) -> bool:
    body = batch.model_dump_json()
    if only_from is None:
        return (
            db.execute("UPDATE batches SET status = ?, body = ? WHERE id = ?", (batch.status, body, batch.id)).rowcount
            > 0
        )
    states = tuple(only_from)
    query = f"UPDATE batches SET status = ?, body = ? WHERE id = ? AND status IN ({','.join('?' * len(states))})"
    return db.execute(query, (batch.status, body, batch.id, *states)).rowcount > 0


def now() -> int:
    return int(time.time())
