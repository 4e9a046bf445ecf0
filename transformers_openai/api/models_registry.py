"""Several models in one server: each loaded (at start, or on the first request naming it), kept while used, and
unloaded when idle or when another needs its room in the one memory budget."""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers_openai.api.handlers import Handlers
from transformers_openai.api.heap import HeapTrimmer
from transformers_openai.engine.intra_op_threads import in_passing_thread
from transformers_openai.metrics import Metrics
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.errors import ModelNotFoundError, ModelUnavailableError, ServiceUnavailableError

logger = logging.getLogger(__name__)

Loader = Callable[[], ServingContext]
GIB = 2**30


class ModelState(str, enum.Enum):
    """Where a listed model stands, as /v1/models shows it."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelSource:
    """A listed model before it is loaded: its names, how to load it and what it is expected to take."""

    name: str
    aliases: frozenset[str]
    loader: Loader
    eager: bool = True  # loaded at start; else on the first request naming it
    estimate_bytes: int = 0  # its weights' size on disk: what a load is charged until measured
    metrics: Metrics | None = None


class ModelSlot:
    """One listed model and its state: the context and handlers while loaded, its requests in flight (leases)."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.state = ModelState.UNLOADED
        self.context: ServingContext | None = None
        self.handlers: Handlers | None = None
        self.charge_bytes = source.estimate_bytes
        self.last_used = time.monotonic()
        self.leases = 0
        self.load_error: BaseException | None = None
        self.loading: asyncio.Task[None] | None = None
        self.on_demand = False  # the load under way was asked for by a request (it waits for it)

    @property
    def name(self) -> str:
        return self.source.name

    def serves(self, name: str) -> bool:
        """Whether a request naming `name` is this model's (asked of its context once loaded: adapters too)."""
        return name in self.source.aliases or (self.context is not None and self.context.serves(name))

    @property
    def running(self) -> bool:
        return self.state is ModelState.LOADED and self.context is not None and self.context.engine.running

    def busy(self) -> bool:
        """Requests hold it (routed to it, or in its engine)."""
        return self.leases > 0 or (self.context is not None and bool(self.context.engine.stats().in_flight))


@dataclass(frozen=True)
class RegistryPolicy:
    """When models load and unload: the memory budget (None: unbounded), the idle time before an unload (None:
    never) and how long a request waits for a load."""

    budget_bytes: int | None = None
    idle_unload_s: float | None = None
    load_timeout_s: float = 300.0
    load_on_demand: bool = False


class ModelRegistry:
    """The listed models; picks one by a request's `model` field and loads, evicts and unloads them."""

    def __init__(
        self,
        sources: list[ModelSource],
        policy: RegistryPolicy | None = None,
        on_loaded: Callable[[ModelSlot], None] | None = None,
    ) -> None:
        self.slots = [ModelSlot(source) for source in sources]
        self.policy = policy or RegistryPolicy()
        self._on_loaded = on_loaded
        self._lock = asyncio.Lock()  # one load or unload at a time: the budget is judged with the others settled
        self._reaper: asyncio.Task[None] | None = None
        self._trim = HeapTrimmer()
        self._on_failure: Callable[[], None] | None = None

    @property
    def several(self) -> bool:
        return len(self.slots) > 1

    @property
    def routed(self) -> bool:
        """Models are picked, listed and reported one by one: several are served, or one loaded on demand."""
        return self.several or self.policy.load_on_demand

    @property
    def default(self) -> ModelSlot:
        return self.slots[0]

    def find(self, name: str | None) -> ModelSlot:
        """The model a request names. With one model loaded at start, always it (its handlers answer a wrong name
        with a 404, as before); else the first listed when the request names none, and a 404 for an unknown name."""
        if not self.routed or name is None:
            return self.default
        for slot in self.slots:
            if slot.serves(name):
                return slot
        served = ", ".join(slot.name for slot in self.slots)
        raise ModelNotFoundError(f"the model '{name}' does not exist; this server serves: {served}", param="model")

    async def start(self, on_failure: Callable[[], None] | None = None) -> None:
        """Loads the eager models one after another in the background; starts the idle unloader."""
        self._on_failure = on_failure
        for slot in self.slots:
            if slot.source.eager and not self.policy.load_on_demand:
                slot.state = ModelState.LOADING
                slot.loading = asyncio.create_task(self._load(slot))
        if self.policy.idle_unload_s is not None:
            self._reaper = asyncio.create_task(self._unload_idle(self.policy.idle_unload_s))

    async def stop(self) -> None:
        tasks = [slot.loading for slot in self.slots if slot.loading is not None]
        if self._reaper is not None:
            tasks.append(self._reaper)
        for task in tasks:
            task.cancel()
        for slot in self.slots:
            if slot.context is not None:
                await slot.context.engine.stop()

    async def wait_loads(self) -> None:
        """Until no load is under way."""
        while tasks := [slot.loading for slot in self.slots if slot.loading is not None]:
            await asyncio.gather(*tasks, return_exceptions=True)

    def eager_ready(self) -> bool:
        """Every model loaded at start is loaded and running (with --load-on-demand: none is)."""
        return all(slot.running for slot in self.slots if slot.source.eager and not self.policy.load_on_demand)

    async def acquire(self, name: str | None) -> ModelSlot:
        """The named model, loaded, held for the request until `release`; a model being loaded at start is a 503 at
        once, one loaded on demand is waited for (up to the policy's bound, then 503 with Retry-After)."""
        slot = self.find(name)
        slot.leases += 1
        slot.last_used = time.monotonic()
        try:
            await self._loaded(slot)
        except BaseException:
            slot.leases -= 1
            raise
        return slot

    def release(self, slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()

    async def _loaded(self, slot: ModelSlot) -> None:
        if slot.running:
            return
        if slot.state is ModelState.LOADED:
            raise ServiceUnavailableError("the engine is not running")
        if slot.state is ModelState.LOADING and not slot.on_demand:
            raise ServiceUnavailableError(self.loading_message(slot))
        if slot.state is ModelState.FAILED and not self.policy.load_on_demand:
            raise ServiceUnavailableError(self.failure_message(slot))
        if slot.loading is None:
            slot.state, slot.on_demand = ModelState.LOADING, True
            slot.loading = asyncio.create_task(self._load(slot))
        try:
            await asyncio.wait_for(asyncio.shield(slot.loading), self.policy.load_timeout_s)
        except TimeoutError:
            raise ModelUnavailableError(
                f"the model '{slot.name}' is still loading after {self.policy.load_timeout_s:.0f}s", retry_after_s=30
            ) from None
        if not slot.running:
            error = slot.load_error
            if isinstance(error, ModelUnavailableError):
                raise error
            raise ServiceUnavailableError(self.failure_message(slot))

    def loading_message(self, slot: ModelSlot) -> str:
        return f"the model '{slot.name}' is loading" if self.several else "the model is loading"

    def failure_message(self, slot: ModelSlot) -> str:
        model = f"the model '{slot.name}'" if self.several else "the model"
        return f"{model} failed to load: {slot.load_error}"

    async def _load(self, slot: ModelSlot) -> None:
        try:
            async with self._lock:
                await self._make_room(slot)
                before = resident_bytes()
                context = await in_passing_thread(slot.source.loader)
                await context.engine.start()
                # Its weight files' size when known: what the process grew by also holds the first load's imports.
                slot.charge_bytes = slot.source.estimate_bytes or max(0, resident_bytes() - before)
                slot.context, slot.handlers = context, Handlers.for_context(context)
                slot.state, slot.load_error = ModelState.LOADED, None
        except ModelUnavailableError as exc:
            slot.state, slot.load_error = ModelState.UNLOADED, exc
        except Exception as exc:
            logger.exception("loading the model %s failed", slot.name)
            slot.state, slot.load_error = ModelState.FAILED, exc
            if not self.routed and self._on_failure is not None:  # one model, loaded at start: the server ends
                self._on_failure()
        finally:
            slot.loading, slot.on_demand = None, False
            slot.last_used = time.monotonic()
        if slot.state is ModelState.LOADED and slot.context is not None:
            if self._on_loaded is not None:
                self._on_loaded(slot)
            logger.info(
                "model %s ready (%s, context %d, about %.2f GiB)",
                slot.name,
                slot.context.model_kind,
                slot.context.max_model_len,
                slot.charge_bytes / GIB,
            )

    def used_bytes(self, besides: ModelSlot) -> int:
        return sum(s.charge_bytes for s in self.slots if s is not besides and s.state is ModelState.LOADED)

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unloads the least recently used idle models until `slot` fits the budget; a ModelUnavailableError when
        it cannot."""
        budget = self.policy.budget_bytes
        if budget is None:
            return
        if slot.charge_bytes > budget:
            raise ModelUnavailableError(
                f"the model '{slot.name}' needs about {slot.charge_bytes / GIB:.2f} GiB, more than the whole memory "
                f"budget (--models-memory-budget {budget / GIB:.2f} GiB)"
            )
        while self.used_bytes(slot) + slot.charge_bytes > budget:
            idle = [s for s in self.slots if s is not slot and s.state is ModelState.LOADED and not s.busy()]
            if not idle:
                busy = ", ".join(s.name for s in self.slots if s.state is ModelState.LOADED)
                raise ModelUnavailableError(
                    f"the model '{slot.name}' (about {slot.charge_bytes / GIB:.2f} GiB) does not fit the memory "
                    f"budget (--models-memory-budget {budget / GIB:.2f} GiB) beside the models in use: {busy}"
                )
            victim = min(idle, key=lambda s: s.last_used)
            logger.info("unloading %s to make room for %s", victim.name, slot.name)
            await self._unload(victim)

    async def _unload(self, slot: ModelSlot) -> None:
        before = resident_bytes()
        context = slot.context
        slot.state, slot.context, slot.handlers = ModelState.UNLOADED, None, None
        if context is not None:
            await context.engine.stop()
        del context
        if slot.source.metrics is not None:
            slot.source.metrics.on_model_unloaded()
        gc.collect()
        self._trim()
        logger.info(
            "unloaded %s: resident memory %.0f -> %.0f MiB", slot.name, before / 2**20, resident_bytes() / 2**20
        )

    async def _unload_idle(self, idle_s: float) -> None:
        """Unloads every model that no request has used for `idle_s` seconds, checking a few times per period."""
        while True:
            await asyncio.sleep(min(1.0, idle_s / 4))
            now = time.monotonic()
            for slot in self.slots:
                if slot.running and not slot.busy() and now - slot.last_used >= idle_s:
                    async with self._lock:
                        if slot.running and not slot.busy():
                            logger.info("unloading %s: idle for %.0fs", slot.name, now - slot.last_used)
                            await self._unload(slot)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
