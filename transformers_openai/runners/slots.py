"""Stable slot ids over rows that move when the batch is compacted."""

from __future__ import annotations


class SlotTable:
    """Maps the engine's stable slot ids to the current row positions of a compacted batch."""

    def __init__(self) -> None:
        self._pos_of: dict[int, int] = {}
        self._slot_at: list[int] = []

    def __len__(self) -> int:
        return len(self._slot_at)

    def __contains__(self, slot: int) -> bool:
        return slot in self._pos_of

    def add(self, slot: int, pos: int) -> None:
        """Names the row just appended at `pos` (always the end of the batch)."""
        if pos != len(self._slot_at):
            raise RuntimeError("rows must be appended at the end of the batch")
        self._pos_of[slot] = pos
        self._slot_at.append(slot)

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
