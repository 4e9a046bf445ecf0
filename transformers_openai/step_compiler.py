"""The process that compiles a server's decode steps beside it: `python -m transformers_openai.step_compiler`.

A CPU server serves with eager decode steps as soon as its weights are loaded and has its compiled steps made in a
child process (`compile_in_child`): it loads the model as the server did (`model_loader.compile_steps_alone`),
compiles into the compile store and exits; the server then loads the stored steps and swaps them in
(`runners/steps/background_steps.py`). Tracing a model is minutes of Python: in a process of its own it holds
another interpreter's lock, not the one the server's engine and event loop share. It runs at a lower priority than
the server, and ends when the server does (its standard input closes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from transformers_openai.settings import Settings

if TYPE_CHECKING:
    from transformers_openai.runners.kv.kv_pool import KVSpace

NICENESS = 10  # the child's priority below the server's: serving comes first on a busy machine


def compile_in_child(settings: Settings, kv_space: KVSpace, store: Path) -> None:
    """Compiles the served model's decode steps into `store` in a child process, over a K/V pool of `kv_space` (the
    server's, so the steps' key and guards match), and waits for it; raises when it fails."""
    job = {"settings": settings.model_dump(mode="json"), "kv": asdict(kv_space), "store": str(store)}
    command = [sys.executable, "-m", "transformers_openai.step_compiler"]
    with subprocess.Popen(command, stdin=subprocess.PIPE, text=True) as child:
        assert child.stdin is not None
        child.stdin.write(json.dumps(job) + "\n")
        child.stdin.flush()
        code = child.wait()  # its standard input stays open until it is done
    if code != 0:
        raise RuntimeError(f"the decode step compile ({' '.join(command)}) exited with code {code}")


def main() -> int:
    job = json.loads(sys.stdin.readline())
    threading.Thread(target=_end_with_the_server, daemon=True).start()
    os.nice(NICENESS)
    settings = Settings.model_validate(job["settings"])
    from transformers_openai.logs import setup_logging
    from transformers_openai.model_loader import compile_steps_alone
    from transformers_openai.runners.kv.kv_pool import KVSpace

    setup_logging(settings.log_level, settings.log_format)
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    return 0 if compile_steps_alone(settings, KVSpace(**job["kv"]), Path(job["store"])) else 1


def _end_with_the_server() -> None:
    """Exits once the server's end of the standard input closes (the server ended)."""
    sys.stdin.read()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
