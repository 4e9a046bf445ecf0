"""Stable slot ids over rows that move when the batch is compacted."""

from __future__ import annotations


class SlotTable:
    """Maps the engine's stable slot ids to the current row positions of a compacted batch."""

    def __init__(self, max_rows: int) -> None:
        self._free = list(range(max_rows - 1, -1, -1))
        self._pos_of: dict[int, int] = {}
        self._slot_at: list[int] = []

    def __len__(self) -> int:
        return len(self._slot_at)

    def add(self, pos: int) -> int:
        """Names the row just appended at `pos` (always the end of the batch)."""
        if pos != len(self._slot_at):
            raise RuntimeError("rows must be appended at the end of the batch")
        slot = self._free.pop()
        self._pos_of[slot] = pos
        self._slot_at.append(slot)
        return slot

    def pos(self, slot: int) -> int:
        return self._pos_of[slot]

    def order(self) -> list[int]:
        """Slots in row order."""
        return list(self._slot_at)

    def remove(self, slot: int, moved_from: int | None) -> None:
        """Forgets `slot`; `moved_from` is the position of the row that now fills its place."""
        pos = self._pos_of.pop(slot)
        if moved_from is not None:
            moved_slot = self._slot_at[moved_from]
            self._slot_at[pos] = moved_slot
            self._pos_of[moved_slot] = pos
        self._slot_at.pop()
        self._free.append(slot)
