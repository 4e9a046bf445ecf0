"""Entry point: `python -m transformers_openai.main --model ...` (every flag is also an environment variable)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from types import FrameType

import uvicorn
from pydantic_settings import CliApp

from transformers_openai.api.app import create_app
from transformers_openai.api.state import AppState
from transformers_openai.logs import setup_logging
from transformers_openai.metrics import Metrics
from transformers_openai.model_loader import load_serving_context
from transformers_openai.settings import Settings

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: refuse new requests (503), let running ones finish, then shut down.

    A second signal, or the drain timeout, shuts down at once.
    """

    def __init__(self, config: uvicorn.Config, state: AppState, timeout_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._timeout_s = timeout_s
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._state.begin_drain()
        logger.info("signal %d: draining running requests (up to %.0fs), then exiting", sig, self._timeout_s)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        if not await self._state.wait_idle(self._timeout_s):
            logger.warning("drain timeout: exiting with requests still running")
        self.should_exit = True


def run(settings: Settings) -> int:
    log_config = setup_logging(settings.log_level, settings.log_format)
    failed = False

    def on_load_failure() -> None:
        nonlocal failed
        failed = True
        os.kill(os.getpid(), signal.SIGINT)  # let uvicorn shut down cleanly, then exit non-zero

    metrics = Metrics(settings.model_name)
    app = create_app(settings, lambda: load_serving_context(settings, metrics), on_load_failure, metrics)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=log_config,
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config, app.state.serving, settings.shutdown_timeout).run()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    settings = CliApp.run(Settings, cli_args=sys.argv[1:] if argv is None else argv)
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
