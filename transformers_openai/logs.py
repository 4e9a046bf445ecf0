"""Logging set-up: plain or JSON lines, each carrying the request id of the HTTP request it belongs to."""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id"}


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request id ('-' outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id and any structured extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class Enqueue(QueueHandler):
    """Hands records to a writer thread, so the engine thread never waits for a write to stderr.

    The queue stays in process: a record goes as it is (its exception info included), with its request id stamped
    and its message fixed on the thread that logged it.
    """

    def __init__(self, handler: logging.Handler) -> None:
        log_queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        super().__init__(log_queue)
        self.addFilter(RequestIdFilter())
        self.listener = QueueListener(log_queue, handler)
        self.listener.start()
        self._listening = True

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg, record.args = record.getMessage(), None
        return record

    def stop(self) -> None:
        """Writes what is still queued and ends the writer thread (at exit; `close` must not: uvicorn's logging
        set-up closes every existing handler, and the root logger keeps using this one)."""
        if self._listening:
            self._listening = False
            self.listener.stop()


def flush_logs() -> None:
    """Writes every queued record now: before `os._exit`, which skips the exit hooks that would."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, Enqueue):
            handler.stop()


def setup_logging(level: str, fmt: str) -> dict[str, Any]:
    """Configures the root logger and returns a uvicorn `log_config` that routes uvicorn's loggers through it."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, Enqueue):
            old.stop()
    queued = Enqueue(handler)
    root.handlers[:] = [queued]
    root.setLevel(level.upper())
    atexit.register(queued.stop)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: {"handlers": [], "propagate": True} for name in _UVICORN_LOGGERS},
    }
