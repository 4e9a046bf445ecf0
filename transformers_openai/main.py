"""Entry point: `python -m transformers_openai.main --model ...` (every flag is also an environment variable).

The settings are parsed first, with nothing heavy imported: `--help` and a bad flag answer at once. The server
(`server.py`: the app, uvicorn, the engine) is imported only once they are valid.
"""

from __future__ import annotations

import sys

from pydantic_settings import CliApp

from transformers_openai.settings import Settings, joined_lora_modules


def main(argv: list[str] | None = None) -> int:
    args = joined_lora_modules(sys.argv[1:] if argv is None else argv)
    settings = CliApp.run(Settings, cli_args=args)
    from transformers_openai.server import run

    return run(settings, args)


if __name__ == "__main__":
    sys.exit(main())
