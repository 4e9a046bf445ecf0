"""Fewer torch threads while another process takes a core, and all of them again once the cores are free.

Every parallel region of a step waits for the slowest thread of the team. When another process keeps one of the
cores busy, one of the engine's threads is always the one the kernel has descheduled, and a step that took 40 ms
takes seconds. A team that fits in the cores left runs at nearly their full speed. So the engine watches its decode
steps: per thread count and per shape (the rows a decode step advances, in powers of two; steps that prefill differ
too much to compare and are not watched) it keeps the recent step times and their median, the usual time. When
`slow_steps` steps in a row take more than `slow_factor` times their usual time on the full count, it drops to the
reduced count. While reduced it probes the full count every `probe_every_s` seconds (twice that after a probe that
failed, up to `probe_most_s`): the full count comes back when `probe_steps` steps on it are no slower than the
reduced count's usual time for their shape now (like with like: one thread is slower than two on free cores, faster
beside a neighbour). A probe step slower than that ends the probe at once, so a neighbour that stays costs one slow
step per probe; since such a step can take seconds, the next probe waits at least three times as long. And every
`explore_every_s` on the full count it tries the reduced count for `probe_steps` steps, kept if they are all faster
than the full count's usual time now: cores busy since the start (a server started beside a neighbour, a machine
loaded throughout) make a slow time the usual one, which no slowdown would reveal. Right after a probe brought the
full count back, that try comes after `probe_every_s`, and twice as long after each try that kept the full count, up
to `explore_every_s`: a probe's few fast steps can be luck beside a neighbour that is still there (the other thread
given its core for a moment), and a slowdown below `slow_factor` (two threads taking twice their time) is never
called slow, so only a try of the reduced count corrects it.

The policy only decides; the caller sets the threads (`IntraOpThreads`). Its cost per step is a dictionary look-up,
a comparison and an append; medians are recomputed every few samples.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

WINDOW = 16  # recent step times kept per (threads, shape)
KNOWN_AFTER = 5  # samples before a median is trusted
MEDIAN_EVERY = 4  # samples between two recomputations of a median
PROBE_SHARE = 3.0  # the wait after a failed probe, in times that probe's step


class _Recent:
    """The recent step times of one thread count and step shape, and their median."""

    __slots__ = ("added", "median", "times")

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.median = 0.0
        self.added = 0

    def add(self, seconds: float) -> None:
        self.times.append(seconds)
        self.added += 1
        if self.added <= KNOWN_AFTER or self.added % MEDIAN_EVERY == 0:
            self.median = statistics.median(self.times)

    @property
    def known(self) -> bool:
        return self.added >= KNOWN_AFTER


class ThreadFallback:
    """Decides the torch threads of the next step from the times of the steps so far (module docstring).

    Args:
        full: the threads the steps use when the cores are free.
        reduced: the threads while another process takes a core.
        clock: seconds, monotonic (a fake one in tests).
    """

    def __init__(
        self,
        full: int,
        reduced: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        slow_factor: float = 2.5,
        slow_steps: int = 3,
        probe_every_s: float = 2.0,
        probe_most_s: float = 4.0,
        probe_steps: int = 3,
        explore_every_s: float = 30.0,
    ) -> None:
        if not 1 <= reduced < full:
            raise ValueError(f"reduced threads ({reduced}) must be at least 1 and fewer than the full {full}")
        self.full, self.reduced = full, reduced
        self.threads = full
        self.fallbacks = 0  # times the steps fell back to `reduced`
        self._clock = clock
        self._slow_factor, self._slow_steps = slow_factor, slow_steps
        self._probe_every_s, self._probe_most_s, self._probe_steps = probe_every_s, probe_most_s, probe_steps
        self._recent: dict[tuple[int, int], _Recent] = {}
        self._slow = 0  # slow steps in a row on the full count
        self._probing = 0  # probe steps still to pass (0: not probing)
        self._wait_s = probe_every_s
        self._next_probe = 0.0
        self._explore_every_s = explore_every_s
        self._exploring = 0  # steps on the reduced count still to pass while on the full count (0: not exploring)
        self._explore_wait_s = explore_every_s
        self._next_explore = clock() + explore_every_s

    def after_step(self, rows: int, seconds: float) -> int:
        """Takes the time of a step that decoded `rows` rows and nothing else (0: a step that prefilled, or idle);
        returns the threads for the next step."""
        if rows <= 0:
            return self.threads
        shape = rows.bit_length()
        if self._probing:
            self._probe(shape, seconds)
        elif self._exploring:
            self._explore(shape, seconds)
        elif self.threads == self.full:
            self._watch(shape, seconds)
        else:
            self._recent_of(self.reduced, shape).add(seconds)
            if self._clock() >= self._next_probe:
                self.threads, self._probing = self.full, self._probe_steps
        return self.threads

    def _recent_of(self, threads: int, shape: int) -> _Recent:
        recent = self._recent.get((threads, shape))
        if recent is None:
            recent = self._recent[(threads, shape)] = _Recent()
        return recent

    def _watch(self, shape: int, seconds: float) -> None:
        recent = self._recent_of(self.full, shape)
        if recent.known and seconds > self._slow_factor * recent.median:
            self._slow += 1  # a slow step is not the shape's usual time: kept out of the median
            if self._slow >= self._slow_steps:
                self._fall_back(seconds, recent.median)
            return
        self._slow = 0
        recent.add(seconds)
        if recent.known and self._clock() >= self._next_explore:
            self.threads, self._exploring = self.reduced, self._probe_steps

    def _explore(self, shape: int, seconds: float) -> None:
        """A step on the reduced count while on the full one: the cores may have been busy since the start, so that
        the full count's usual time is already a slow one. The reduced count stays if it is faster now."""
        full = self._recent.get((self.full, shape))
        if full is not None and full.known:
            self._recent_of(self.reduced, shape).add(seconds)
        if full is None or not full.known or seconds >= full.median:  # unknown shape: back, to learn its time
            self.threads, self._exploring = self.full, 0
            self._explore_wait_s = min(2 * self._explore_wait_s, self._explore_every_s)
            self._next_explore = self._clock() + self._explore_wait_s
            return
        self._exploring -= 1
        if not self._exploring:
            self._fall_back(seconds, full.median)

    def _fall_back(self, seconds: float, usual: float) -> None:
        """To the reduced count: after slow steps on the full one, or after faster ones on the reduced one."""
        slower = self.threads == self.full
        self.threads, self._slow = self.reduced, 0
        self._next_explore = self._clock() + self._explore_every_s
        self.fallbacks += 1
        self._wait_s = self._probe_every_s
        self._next_probe = self._clock() + self._wait_s
        logger.warning(
            "%s %.0f ms against a usual %.0f ms on %d: another process is taking a core; running on %d thread%s "
            "until the cores are free (trying %d every %g-%g s)",
            "step" if slower else f"steps on {self.reduced} thread{'' if self.reduced == 1 else 's'} take",
            seconds * 1000,
            usual * 1000,
            self.full,
            self.reduced,
            "" if self.reduced == 1 else "s",
            self.full,
            self._probe_every_s,
            self._probe_most_s,
        )

    def _probe(self, shape: int, seconds: float) -> None:
        """A step on the full count while reduced: it passes if no slower than the reduced count is now."""
        reduced = self._recent.get((self.reduced, shape))
        full = self._recent.get((self.full, shape))
        if reduced is not None and reduced.known:
            bar = reduced.median
        elif full is not None and full.known:
            bar = self._slow_factor * full.median
        else:
            bar = 0.0  # a shape neither count has a usual time for: back to the reduced count, to learn it
        if seconds > bar:
            self._probing = 0
            self.threads = self.reduced
            # The wait doubles up to probe_most_s, and is at least PROBE_SHARE times the failed step, which can take
            # seconds beside a neighbour: probes then take at most about a quarter of the time.
            self._wait_s = max(min(2 * self._wait_s, self._probe_most_s), PROBE_SHARE * seconds)
            self._next_probe = self._clock() + self._wait_s
            return
        self._recent_of(self.full, shape).add(seconds)
        self._probing -= 1
        if not self._probing:
            self._explore_wait_s = self._probe_every_s  # soon: the probe may have been luck beside the neighbour
            self._next_explore = self._clock() + self._explore_wait_s
            logger.warning("steps on %d threads are fast again: the cores are free, back to %d", self.full, self.full)
