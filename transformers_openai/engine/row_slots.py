"""The slots naming a runner's rows: the engine gives one to each request at admission and takes it back when the
request leaves."""

from __future__ import annotations


class RowSlots:
    """Slots `0 .. max_rows - 1`, each held by at most one request; the one given back last is given first."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._free = list(range(max_rows - 1, -1, -1))

    @property
    def in_use(self) -> int:
        return self.max_rows - len(self._free)

    def take(self) -> int | None:
        """A free slot, or None when every row is held."""
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
