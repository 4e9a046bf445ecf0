"""The processes of a tensor-parallel server started without torchrun: rank 0 starts the others and watches them.

Rank 0 is the process the user started; it starts ranks 1..N-1 as children running the same command, with the
environment torchrun would give them. A rank that dies takes the server down (exit 1) rather than leaving it
waiting for a peer that will never answer; a rank whose parent died exits the same way.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from transformers_openai.logs import flush_logs
from transformers_openai.parallel.rendezvous import LoopbackRendezvous

logger = logging.getLogger(__name__)

POLL_S = 0.2


class RankProcesses:
    """Ranks 1..size-1 as child processes of this one (rank 0), watched from a thread."""

    def __init__(self, children: list[subprocess.Popen[bytes]], rendezvous: LoopbackRendezvous) -> None:
        self._children = children
        self.rendezvous = rendezvous  # the group's store, which this process serves once it joins (`join_ranks`)
        self._stopping = False
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    @classmethod
    def start(cls, size: int, argv: Sequence[str]) -> RankProcesses:
        """Sets this process up as rank 0 of `size` and starts the others with the same arguments; they meet at a
        store on 127.0.0.1 that this process serves (see `rendezvous`)."""
        rendezvous = LoopbackRendezvous()
        group = rendezvous.env(size)
        if sys.platform == "linux" and "GLOO_SOCKET_IFNAME" not in os.environ:
            group["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks on this machine: gloo need not guess from the host name
        os.environ.update(group, RANK="0", LOCAL_RANK="0")
        children = [
            subprocess.Popen(
                [sys.executable, "-m", "transformers_openai.main", *argv],
                env={**os.environ, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            )
            for rank in range(1, size)
        ]
        logger.info("started ranks 1..%d (pids %s)", size - 1, ", ".join(str(c.pid) for c in children))
        return cls(children, rendezvous)

    def _watch(self) -> None:
        while not self._stopping:
            for rank, child in enumerate(self._children, start=1):
                code = child.poll()
                if code is not None and not self._stopping:
                    logger.error("rank %d exited (code %d): the model cannot run without it; exiting", rank, code)
                    self._kill()
                    flush_logs()
                    os._exit(1)  # the engine may be waiting on that rank: nothing else would end
            time.sleep(POLL_S)

    def stop(self, timeout_s: float) -> bool:
        """Waits for the ranks to exit (after rank 0 told them to), killing those still running after `timeout_s`;
        True when all of them exited 0."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        clean = True
        for child in self._children:
            try:
                clean &= child.wait(max(deadline - time.monotonic(), 0)) == 0
            except subprocess.TimeoutExpired:
                clean = False
        self._kill()
        return clean

    def _kill(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.kill()
                child.wait()


def exit_with_parent() -> None:
    """A rank other than 0: exits as soon as the process that started it (rank 0, or torchrun) is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        logger.error("rank %s: the process that started it is gone; exiting", os.environ.get("RANK"))
        flush_logs()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
