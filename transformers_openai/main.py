"""Entry point: `python -m transformers_openai.main --model ...` (every flag is also an environment variable)."""

from __future__ import annotations

import logging
import os
import signal
import sys

import uvicorn
from pydantic_settings import CliApp

from transformers_openai.api.app import create_app
from transformers_openai.model_loader import load_serving_context
from transformers_openai.settings import Settings


def run(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    failed = False

    def on_load_failure() -> None:
        nonlocal failed
        failed = True
        os.kill(os.getpid(), signal.SIGTERM)  # let uvicorn shut down cleanly, then exit non-zero

    app = create_app(settings, lambda: load_serving_context(settings), on_load_failure)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, timeout_graceful_shutdown=5)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    settings = CliApp.run(Settings, cli_args=sys.argv[1:] if argv is None else argv)
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
