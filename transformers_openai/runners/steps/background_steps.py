"""Compiled decode steps made ready in the background while eager steps serve, installed between two engine steps.

Compiling a decode step takes minutes on a small CPU; the server answers meanwhile with eager steps. A thread of its
own (it ends once done, so no OpenMP team of it outlives it, and it runs torch with one thread) builds or loads the
paged decode kernel, has the steps compiled elsewhere when the store lacks them (a child process that loads the model
the same way and compiles into the store: the long tracing holds another interpreter's lock, not the server's) and
loads them from the store onto a `FixedSteps` of its own, which no engine step touches yet: the pool's running state
and the staging buffers of the steps that serve stay the engine thread's alone. The engine thread then takes the
ready steps at the start of a step (`take`): one padding run of each graph, and decode steps run compiled from then on.
A compile or load that fails leaves the eager steps serving, with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from transformers_openai.runners.base import DecodeStep
from transformers_openai.runners.steps.fixed_steps import FixedSteps
from transformers_openai.runners.steps.step_store import last_compile_seconds, record_compile_seconds

logger = logging.getLogger(__name__)


class BackgroundSteps:
    """Prepares `fixed`'s compiled decode steps off the engine thread (see the module's docstring).

    Args:
        fixed: the steps to compile, not yet stepping (the engine runs its eager steps meanwhile).
        store: the compile store the steps are loaded from (and compiled into by `compile_elsewhere`).
        model_key: what names the model and its weights' layout in the store's key.
        compile_elsewhere: compiles this model's decode steps into `store` elsewhere (a child process) and returns
            when done; raises when it fails.
        on_change: told the decode step in use: "compiling" at start, "ready" once made, "compiled" once swapped
            in, or "eager" where the compiled step cannot be had.
    """

    def __init__(
        self,
        fixed: FixedSteps,
        store: Path,
        model_key: Sequence[str],
        compile_elsewhere: Callable[[], None],
        on_change: Callable[[DecodeStep], None] | None = None,
    ) -> None:
        self._fixed = fixed
        self._store = store
        self._model_key = list(model_key)
        self._compile_elsewhere = compile_elsewhere
        self._on_change = on_change
        self._ready: dict[int, Callable[..., torch.Tensor]] | None = None
        self._compile_seconds: float | None = None  # None: loaded from the store, nothing compiled
        self._started = time.monotonic()
        self.finished = threading.Event()  # set once the thread is done, ready or not
        self._thread = threading.Thread(target=self._prepare, name="decode-step-compile", daemon=True)

    def start(self) -> None:
        self._tell("compiling")
        self._thread.start()

    def take(self) -> FixedSteps | None:
        """On the engine thread, between two steps: the fixed steps, now compiled, once they are ready (once: later
        calls return None); None before, or when they failed (eager steps go on)."""
        steps = self._ready
        if steps is None:
            return None
        self._ready = None
        began = time.monotonic()
        try:
            with torch.inference_mode():
                self._fixed.install(steps)
        except Exception:
            logger.warning("the compiled decode step failed its first run: decode steps stay eager", exc_info=True)
            self._tell("eager")
            return None
        took = "" if self._compile_seconds is None else f", compiled in {self._compile_seconds:.0f} s"
        logger.info(
            "decode steps now run compiled (ready %.0f s after start%s; swapped in in %.2f s)",
            began - self._started,
            took,
            time.monotonic() - began,
        )
        self._tell("compiled")
        return self._fixed

    def _prepare(self) -> None:
        torch.set_num_threads(1)
        steps = None
        try:
            with torch.inference_mode():  # the global state the steps were compiled under
                steps = self._load_or_compile()
        except Exception:
            logger.warning("the decode step could not be compiled: decode steps stay eager", exc_info=True)
        finally:
            self._tell("eager" if steps is None else "ready")
            self._ready = steps
            self.finished.set()

    def _tell(self, step: DecodeStep) -> None:
        if self._on_change is not None:
            self._on_change(step)

    def _load_or_compile(self) -> dict[int, Callable[..., torch.Tensor]] | None:
        """The stored steps, loaded; compiled into the store first where it lacks them or holds ones that cannot be
        used (cut short, compiled for other inputs: the child compiles anew over them)."""
        fixed, store, key = self._fixed, self._store, self._model_key
        fixed.read_in_place(store)  # built here when missing, before the child looks for it
        if fixed.has_stored(store, key):
            logger.info("loading the compiled decode step from %s, eager steps serving meanwhile", store)
            steps = fixed.stored(store, key)
            if steps is not None:
                return steps
        last = last_compile_seconds(store)
        logger.info(
            "compiling the decode step (two graphs) in a child process, eager steps serving meanwhile: %s",
            f"the last compile took {last:.0f} s" if last is not None else "minutes on a small CPU",
        )
        began = time.monotonic()
        self._compile_elsewhere()
        self._compile_seconds = time.monotonic() - began
        record_compile_seconds(store, self._compile_seconds)
        steps = fixed.stored(store, key)
        if steps is None:
            logger.warning("the compiled decode step in %s could not be used: decode steps stay eager", store)
        return steps
