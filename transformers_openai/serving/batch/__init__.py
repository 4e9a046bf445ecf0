"""The Batch API: files and batches stored on disk, run in the background through the serving handlers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers_openai.serving.batch.batches import BatchHandler
from transformers_openai.serving.batch.files import BatchLimits, FileHandler
from transformers_openai.serving.batch.lines import EndpointHandlers
from transformers_openai.serving.batch.runner import BatchRunner
from transformers_openai.serving.batch.store import BatchStore

__all__ = ["BatchApi", "BatchLimits"]


@dataclass(frozen=True)
class BatchApi:
    """What the /v1/files and /v1/batches routes call, and the runner the app's lifespan starts and stops."""

    files: FileHandler
    batches: BatchHandler
    runner: BatchRunner

    @classmethod
    def under(cls, root: Path, limits: BatchLimits, handlers: Callable[[], EndpointHandlers]) -> BatchApi:
        """Files and batches kept under `root`, which is made on first use (nothing is touched before)."""
        store = BatchStore(root)
        runner = BatchRunner(store, limits, handlers)
        return cls(FileHandler(store, limits), BatchHandler(store, runner), runner)
