"""Who waits, who runs: admission limits, the waiting queue and cancellation."""

from __future__ import annotations

from collections import OrderedDict

from transformers_openai.engine.sequence import Sequence


class Scheduler:
    """Keeps the waiting queue (FIFO) and the running set, within their limits.

    Args:
        max_running: rows stepped together (the batch size).
        max_waiting: requests allowed to wait beyond the running batch.
        max_prefill_tokens: prompt tokens admitted in one step (at least one request is always admitted),
            so a burst of long prompts does not stall the decoding rows for long.
    """

    def __init__(self, max_running: int, max_waiting: int, max_prefill_tokens: int = 4096) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()
        self.running: dict[str, Sequence] = {}

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_waiting

    def add(self, seq: Sequence) -> None:
        self.waiting[seq.request_id] = seq

    def admissible(self) -> list[Sequence]:
        """Pops the waiting requests that may start this step, oldest first."""
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            seq = next(iter(self.waiting.values()))
            if admitted and seq.prompt_len > budget:
                break
            budget -= seq.prompt_len
            del self.waiting[seq.request_id]
            admitted.append(seq)
        return admitted

    def start(self, seq: Sequence) -> None:
        self.running[seq.request_id] = seq

    def remove(self, request_id: str) -> Sequence | None:
        """Takes a request out of wherever it is; returns it, or None if it is unknown or done."""
        return self.waiting.pop(request_id, None) or self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
