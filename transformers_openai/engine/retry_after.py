"""How soon a full server will have room: the rows' remaining tokens at the recent step time (a 429's Retry-After)."""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Iterable


class RetryAfter:
    """Estimates when the requests in flight will have left enough room for a refused one.

    Each running row leaves after its remaining tokens, one per decode step; the waiting requests take the rows
    that come free, in order, and leave after their own tokens. The answer is when the `ahead`-th of them has
    left, at the recent time of a step. A row's tokens are bounded by its `max_tokens`, and by what recent
    answers took (their 90th percentile), since most answers end at a stop token long before their limit.

    Args:
        window: how many recent steps and answers the estimate remembers (steps of the idle server never count).
    """

    MIN_S, MAX_S = 1, 60

    def __init__(self, window: int = 64) -> None:
        self._steps: deque[float] = deque(maxlen=window)
        self._lengths: deque[int] = deque(maxlen=window)

    def record_step(self, seconds: float) -> None:
        """A step that decoded rows took `seconds` (called on the engine thread)."""
        self._steps.append(seconds)

    def record_answer(self, tokens: int) -> None:
        """An answer ended by itself (a stop, or its limit) after `tokens` tokens."""
        self._lengths.append(tokens)

    def seconds(self, ahead: int, rows: int, running: Iterable[tuple[int, int]], waiting: Iterable[int]) -> int:
        """Whole seconds, within [MIN_S, MAX_S], until `ahead` requests have left.

        Args:
            rows: the batch size (rows stepped together).
            running: (tokens generated, tokens left at most) of each running request.
            waiting: the most tokens each waiting request may take, in queue order.
        """
        steps = list(self._steps)
        if ahead <= 0 or not steps:
            return self.MIN_S
        typical = self._typical_length()
        departures = [self._left(generated, most, typical) for generated, most in running]  # in steps from now
        rows_free_at = departures + [0.0] * max(0, rows - len(departures))
        heapq.heapify(rows_free_at)
        for most in waiting:  # each takes the first row to come free, and leaves after its own tokens
            leaves = heapq.heappop(rows_free_at) + 1 + self._left(0, most, typical)
            departures.append(leaves)
            heapq.heappush(rows_free_at, leaves)
        if not departures:
            return self.MIN_S
        departures.sort()
        leaving = departures[min(ahead, len(departures)) - 1]
        return min(self.MAX_S, max(self.MIN_S, math.ceil(leaving * statistics.median(steps))))

    def _typical_length(self) -> int | None:
        if len(self._lengths) < 8:
            return None
        return int(statistics.quantiles(self._lengths, n=10)[-1])

    @staticmethod
    def _left(generated: int, most: int, typical: int | None) -> float:
        if typical is None:
            return float(max(most, 1))
        expected = typical - generated if typical > generated else typical // 2
        return float(max(1, min(most, expected)))
