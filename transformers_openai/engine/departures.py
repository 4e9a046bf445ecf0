"""How soon a full server will have room: the recent rate at which requests leave it."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class Departures:
    """Remembers when the last requests left (finished or aborted) to estimate a 429's Retry-After.

    Args:
        window: how many recent departures the rate is taken over.
        clock: seconds, monotonic (a parameter for tests).
    """

    MIN_S, MAX_S = 1, 60

    def __init__(self, window: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._clock = clock

    def record(self) -> None:
        self._times.append(self._clock())

    def rate_per_s(self) -> float | None:
        """Departures per second over the remembered ones up to now; None before two are known."""
        if len(self._times) < 2:
            return None
        span = self._clock() - self._times[0]
        return (len(self._times) - 1) / span if span > 0 else None

    def retry_after_s(self, ahead: int) -> int:
        """Whole seconds until `ahead` more requests have left at the recent rate, within [1, 60]."""
        rate = self.rate_per_s()
        if rate is None:
            return self.MIN_S
        return min(self.MAX_S, max(self.MIN_S, math.ceil(ahead / rate)))
