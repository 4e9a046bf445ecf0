"""A rank other than 0: loads its shard of the model and of the K/V pool, then runs rank 0's steps until told to
stop. It serves no HTTP and keeps no request state."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from transformers_openai.logs import setup_logging
from transformers_openai.parallel.lockstep import follow
from transformers_openai.parallel.processes import exit_with_parent
from transformers_openai.parallel.ranks import Ranks
from transformers_openai.runners.steps.paged_step import StepExecutor
from transformers_openai.settings import Settings

logger = logging.getLogger(__name__)


def run_follower(settings: Settings, load: Callable[[Settings], tuple[Ranks, StepExecutor]]) -> int:
    """Runs this rank until rank 0 stops it; `load` (the loader's `load_follower`, handed down by `main`: this
    package sits below the loader) builds its shard."""
    setup_logging(settings.log_level, settings.log_format)
    # Rank 0 decides when the ranks stop (after its drain); a signal to the whole process group must not cut the
    # steps of the requests it is finishing.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    exit_with_parent()
    ranks, executor = load(settings)
    logger.info("rank %d of %d: ready", ranks.rank, ranks.size)
    try:
        follow(executor, ranks)
    except Exception:  # rank 0 gone (a broken connection), or a step that failed here: the others cannot go on
        logger.exception("rank %d: exiting", ranks.rank)
        return 1
    logger.info("rank %d: stopped", ranks.rank)
    return 0
