"""The app's serving state: the listed models (one, or several picked by name), started and stopped with the app."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from transformers_openai.api.handlers import Handlers
from transformers_openai.api.models_registry import Loader, ModelRegistry, ModelSlot, ModelState
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.errors import ServiceUnavailableError

__all__ = ["AppState", "Handlers", "Loader"]

logger = logging.getLogger(__name__)


class AppState:
    """The models served; until the first (or each eagerly loaded one) is loaded, requests get 503."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.draining = False

    @property
    def load_error(self) -> BaseException | None:
        return self.registry.default.load_error

    async def start(self, on_failure: Callable[[], None] | None = None) -> None:
        await self.registry.start(on_failure)

    async def stop(self) -> None:
        await self.registry.stop()

    async def wait_ready(self) -> None:
        await self.registry.wait_loads()

    def ready(self) -> bool:
        return self.registry.eager_ready() and not self.draining

    def begin_drain(self) -> None:
        """Stops admitting new requests; those in flight go on."""
        self.draining = True

    def _contexts(self) -> list[ServingContext]:
        return [slot.context for slot in self.registry.slots if slot.context is not None]

    def fail_in_flight(self, message: str) -> int:
        """Ends every request in flight with a shutdown error (streams get an error event and [DONE])."""
        return sum(context.engine.fail_in_flight(message) for context in self._contexts())

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is in flight (True) or the timeout passes (False)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(context.engine.stats().in_flight for context in self._contexts()):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def status_message(self) -> str:
        if self.draining:
            return "the server is shutting down"
        registry = self.registry
        waiting = [s for s in registry.slots if s.source.eager and not registry.policy.load_on_demand and not s.running]
        slot = waiting[0] if waiting else registry.default
        if slot.state is ModelState.FAILED:
            return registry.failure_message(slot)
        if slot.state is ModelState.LOADING or slot.context is None:
            return registry.loading_message(slot)
        return "the engine is not running"

    def context(self) -> ServingContext:
        """The first listed model's context (a server with one model: its only one); 503 unless it runs."""
        slot = self.registry.default
        if not slot.running or self.draining or slot.context is None:
            raise ServiceUnavailableError(self.status_message())
        return slot.context

    def handlers(self) -> Handlers:
        self.context()
        handlers = self.registry.default.handlers
        assert handlers is not None  # set with the context
        return handlers

    async def acquire(self, name: str | None) -> ModelSlot:
        """The model a request names, loaded and held for it (`registry.release` when the response ends)."""
        if self.draining:
            raise ServiceUnavailableError(self.status_message())
        return await self.registry.acquire(name)
