"""Which prompts share one batched prefill: groups of similar lengths, so the padding stays small."""

from __future__ import annotations


def length_groups(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Splits indices of `lengths` into groups, shortest prompts first, each padded to its longest.

    A group grows while its padding (longest x members - real tokens) stays within `max_padding` times its real
    tokens; every index lands in exactly one group.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if current and n * (len(current) + 1) > (1 + max_padding) * (real + n):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        groups.append(current)
    return groups
