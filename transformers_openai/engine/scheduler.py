"""Who waits, who is being prefilled, who runs: admission limits, the prefill budget and cancellation."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from transformers_openai.engine.sequence import Sequence


class Scheduler:
    """Keeps the waiting queue (by priority, then FIFO), the requests being prefilled and the running set, within
    their limits.

    Args:
        max_running: rows stepped together (the batch size); requests being prefilled count toward it.
        max_waiting: requests allowed to wait beyond the running batch.
        max_prefill_tokens: prompt tokens prefilled in one step. A longer prompt is prefilled in chunks
            over several steps, so the running rows keep decoding in between; every step makes progress.
    """

    def __init__(self, max_running: int, max_waiting: int, max_prefill_tokens: int = 4096) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()
        self.prefilling: OrderedDict[str, Sequence] = OrderedDict()
        self.running: dict[str, Sequence] = {}
        # Requests whose consumer is not taking their outputs (a client that stopped reading): not stepped, holding
        # no K/V memory, until `resume`.
        self.paused: dict[str, Sequence] = {}

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_waiting

    def add(self, seq: Sequence) -> None:
        # The next part of a request already served goes before the newcomers of its priority.
        self._enqueue(seq, first=seq.request.continuation)

    def _enqueue(self, seq: Sequence, first: bool) -> None:
        """Puts `seq` in the waiting queue, which stays sorted by priority (lower first): behind every request of
        its priority or, with `first`, ahead of them. With one priority throughout this is a plain FIFO append
        (or push to the front), with no scan."""
        waiting, priority = self.waiting, seq.request.priority
        if not waiting:
            waiting[seq.request_id] = seq
            return
        edge = next(iter(waiting.values())) if first else next(reversed(waiting.values()))
        if first and edge.request.priority >= priority:
            waiting[seq.request_id] = seq
            waiting.move_to_end(seq.request_id, last=False)
            return
        if not first and edge.request.priority <= priority:
            waiting[seq.request_id] = seq
            return
        queued = list(waiting.values())
        behind = [
            other.request.priority < priority or (not first and other.request.priority == priority) for other in queued
        ]
        queued.insert(behind.index(False) if False in behind else len(queued), seq)
        waiting.clear()
        waiting.update((other.request_id, other) for other in queued)

    def prefill_plan(self, reserve: Callable[[Sequence], bool] = lambda seq: True) -> list[tuple[Sequence, int]]:
        """This step's prefill work: (sequence, prompt tokens to process), in the waiting queue's order.

        Prefills already under way continue first; then waiting requests start while rows, budget and K/V memory
        remain (`reserve` sets aside a request's row and K/V memory, or says it does not fit: it then waits, and so
        do the ones behind it). The requests starting in one step share a priority: a less urgent one waits a step
        rather than lengthen an urgent one's prefill (its time to first token). A request's declared overhead (an
        encoder pass) counts against the budget too: one whose overhead does not fit waits for the next step, unless
        nothing else is planned (every step makes progress).
        """
        plan: list[tuple[Sequence, int]] = []
        budget = self.max_prefill_tokens
        for seq in self.prefilling.values():
            if budget <= 0:
                return plan
            take = min(seq.prefill.remaining, budget)
            plan.append((seq, take))
            budget -= take
        first_priority: int | None = None
        while self.waiting and budget > 0 and len(self.running) + len(self.prefilling) < self.max_running:
            head = next(iter(self.waiting.values()))
            overhead = head.prefill.overhead
            if plan and overhead >= budget:
                break
            if first_priority is not None and head.request.priority > first_priority:
                break  # a less urgent request starts next step: the urgent one's prefill is not made longer
            first_priority = head.request.priority
            if not reserve(head):
                break
            _, seq = self.waiting.popitem(last=False)
            self.prefilling[seq.request_id] = seq
            take = min(seq.prefill.remaining, budget)
            plan.append((seq, take))
            budget -= take + overhead
        return plan

    def start(self, seq: Sequence) -> None:
        """The sequence's prompt is in: it runs from now on."""
        self.prefilling.pop(seq.request_id, None)
        self.running[seq.request_id] = seq

    def kv_holders(self) -> list[Sequence]:
        """The requests holding K/V memory: running, or being prefilled with their reservation."""
        return [*self.running.values(), *(s for s in self.prefilling.values() if s.prefill.kv is not None)]

    def requeue(self, seq: Sequence) -> None:
        """A preempted request waits again, ahead of the newcomers of its priority."""
        self.remove(seq.request_id)
        self._enqueue(seq, first=True)

    def pause(self, seq: Sequence) -> None:
        """Sets a request aside until `resume` (already taken out with `remove`, its K/V memory given back)."""
        self.paused[seq.request_id] = seq

    def resume(self, request_id: str) -> Sequence | None:
        """A paused request waits again, ahead of the newcomers; None if it is not paused."""
        seq = self.paused.pop(request_id, None)
        if seq is not None:
            self.requeue(seq)
        return seq

    def remove(self, request_id: str) -> Sequence | None:
        """Takes a request out of wherever it is; returns it, or None if it is unknown or done."""
        for queue in (self.waiting, self.prefilling, self.running, self.paused):
            seq = queue.pop(request_id, None)
            if seq is not None:
                return seq
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)
