"""The global budget of request body bytes in flight: what all requests being received or parsed hold at once."""

from __future__ import annotations


class ByteBudget:
    """Bytes held over all requests, never above `limit`: a take that would pass it is refused whole.

    The server runs on one event loop, so takes and releases need no lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0  # the most ever held at once (for tests and figures)

    def hold(self) -> Hold:
        """A request's share of the budget, to be closed when the request ends."""
        return Hold(self)

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        self.peak = max(self.peak, self.held)
        return True

    def release(self, size: int) -> None:
        self.held -= size


class Hold:
    """The bytes one request holds. `close` gives back what is left, once, on whichever path the request ends."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.size = 0
        self._closed = False

    def take(self, size: int) -> bool:
        """Adds `size` bytes; False (and nothing taken) when they would pass the budget or the hold is closed."""
        if self._closed or not self._budget.take(size):
            return False
        self.size += size
        return True

    def release(self, size: int) -> None:
        """Gives back `size` bytes of this hold (at most what it holds)."""
        size = min(size, self.size)
        self.size -= size
        self._budget.release(size)

    def close(self) -> None:
        self.release(self.size)
        self._closed = True
