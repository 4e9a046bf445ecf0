"""The server process: the app, uvicorn and the drain on a signal (`run`), started by `main.py` once it has parsed
the settings."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from sse_starlette.sse import AppStatus

from transformers_openai.api.app import create_app
from transformers_openai.api.http_protocol import ConnectionLimits, GuardedH11Protocol
from transformers_openai.api.models_registry import ModelSource, RegistryPolicy
from transformers_openai.api.state import AppState
from transformers_openai.logs import setup_logging
from transformers_openai.metrics import Metrics
from transformers_openai.model_list import memory_budget, served_models, weights_bytes
from transformers_openai.serving.context import ServingContext
from transformers_openai.settings import Settings

if TYPE_CHECKING:
    from transformers_openai.parallel.leader import Leader

logger = logging.getLogger(__name__)


SHUTDOWN_MESSAGE = "the server is shutting down"
RANKS_EXIT_S = 30.0  # how long the other tensor-parallel ranks get to exit once told to


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: refuse new requests (503), let running ones finish, then shut down (exit 0).

    A second signal, or a drain that runs out of time, ends at once: every open request is told why (a 503
    error; streams get an error event and `data: [DONE]`), and the process exits 1.
    """

    def __init__(self, config: uvicorn.Config, state: AppState, timeout_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._timeout_s = timeout_s
        self._draining = False
        self.forced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started or self.forced:
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_event_loop()
        if self._draining:
            logger.warning("signal %d again: ending every request now", sig)
            loop.call_soon_threadsafe(self._end_now)
            return
        self._draining = True
        self._state.begin_drain()
        logger.info("signal %d: draining running requests (up to %.0fs), then exiting", sig, self._timeout_s)
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        if not await self._state.wait_idle(self._timeout_s):
            logger.warning("drain timeout after %.0fs: ending the requests still running", self._timeout_s)
            self._end_now()
            return
        self.should_exit = True

    def _end_now(self) -> None:
        if self.forced:
            return
        self.forced = True
        ended = self._state.fail_in_flight(SHUTDOWN_MESSAGE)
        logger.warning("ended %d requests in flight", ended)
        self.should_exit = True  # uvicorn waits for their responses (error events, [DONE]) to go out


def _load(settings: Settings, metrics: Metrics, leader: Leader | None) -> ServingContext:
    """One model's serving context, in the loading thread."""
    # Imported here: transformers' model classes import every quantization library installed (torchao asks CUDA
    # about itself as it is imported), which `--help` and importing this module need not pay for.
    from transformers_openai.model_loader import load_serving_context

    return load_serving_context(settings, metrics, leader)


def run(settings: Settings, argv: Sequence[str] = ()) -> int:
    """Serves until a signal ends it; returns the exit code. `argv`: the command's arguments, which the other ranks
    of a tensor-parallel server get too."""
    try:
        listed = served_models(settings)
    except ValueError as exc:  # --models / --models-config: said plainly, before anything starts
        print(f"error: {exc}", file=sys.stderr)
        return 2
    leader: Leader | None = None
    if settings.tensor_parallel_size > 1:
        # Imported only here: they import torch.distributed and transformers, which a plain server loads later.
        from transformers_openai.parallel.follower import run_follower
        from transformers_openai.parallel.leader import Leader

        if int(os.environ.get("RANK", "0")) != 0:
            from transformers_openai.model_loader import load_follower  # imports transformers' model classes

            return run_follower(settings, load_follower)
    log_config = setup_logging(settings.log_level, settings.log_format)
    if settings.tensor_parallel_size > 1:
        leader = Leader.start(settings.tensor_parallel_size, argv)
    failed = False

    def on_load_failure() -> None:
        nonlocal failed
        failed = True
        os.kill(os.getpid(), signal.SIGINT)  # let uvicorn shut down cleanly, then exit non-zero

    metrics = Metrics(listed[0].model_name, compat=settings.metrics_compat)
    sources = [
        ModelSource(
            model.model_name,
            frozenset({model.model_name, model.model}),
            functools.partial(_load, model, observer, leader),
            estimate_bytes=weights_bytes(model.model),
            metrics=observer,
        )
        for model, observer in zip(
            listed, [metrics, *(metrics.for_model(m.model_name) for m in listed[1:])], strict=True
        )
    ]
    policy = RegistryPolicy(
        budget_bytes=memory_budget(settings, len(listed)),
        idle_unload_s=settings.idle_unload_seconds,
        load_timeout_s=settings.model_load_timeout,
        load_on_demand=settings.load_on_demand,
    )
    app = create_app(settings, sources[0].loader, on_load_failure, metrics, sources, policy)
    limits = ConnectionLimits(settings.header_timeout, settings.body_timeout, settings.max_connections)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=log_config,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=settings.keep_alive_timeout,
        http=functools.partial(GuardedH11Protocol, limits=limits),  # type: ignore[arg-type]
    )
    # Shutdown is ours (DrainingServer): sse-starlette must not cut streams before they get their error event.
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]
    server = DrainingServer(config, app.state.serving, settings.shutdown_timeout)
    server.run()
    ranks_clean = leader.close(RANKS_EXIT_S) if leader is not None else True
    return 1 if failed or server.forced or not ranks_clean else 0
