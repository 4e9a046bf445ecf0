"""Stop strings matched on text, holding back what could still become a stop string."""

from __future__ import annotations

from collections import deque
from weakref import WeakValueDictionary

from transformers_openai.engine.stop_automaton import StopAutomaton


class StopAutomata:
    """The automata of the stop strings in use (an engine's): the n choices of a request, and requests with the same
    stop strings, share one while any of them runs."""

    def __init__(self) -> None:
        self._live: WeakValueDictionary[tuple[str, ...], StopAutomaton] = WeakValueDictionary()

    def get(self, stops: tuple[str, ...]) -> StopAutomaton:
        automaton = self._live.get(stops)
        if automaton is None:
            automaton = self._live[stops] = StopAutomaton(stops)
        return automaton


class StopMatcher:
    """Feeds text deltas through; cuts the output at the first stop string.

    It holds back the longest tail of the text that is a prefix of some stop string, so a stop
    string split across several tokens is still found and never shown to the client. The result
    does not depend on how the text was split: a complete stop string waits while a longer one that
    starts earlier may still complete (stops "b" and "ab": "a" + "b" cuts before "a", as "ab" does).

    Each character is read once, through an automaton built here (once per request), so a token costs
    O(its length) whatever the number and length of the stop strings and of the held-back tail.
    """

    def __init__(self, stops: tuple[str, ...] | list[str], automata: StopAutomata | None = None):
        kept = tuple(s for s in stops if s)
        self._automaton = None if not kept else automata.get(kept) if automata is not None else StopAutomaton(kept)
        self._state = 0  # the automaton's: its depth is the length of the held-back tail
        # Positions count characters since the start of the text: what was read, emitted, and where the earliest
        # complete stop string read so far starts (-1 while none has).
        self._read = 0
        self._emitted = 0
        self._cut = -1
        self._cut_len = 0  # the length of the stop string that starts at `_cut`
        self._held: deque[str] = deque()  # the text read and not emitted, the first piece from `_offset` on
        self._offset = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once `stopped`

    def push(self, delta: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        automaton = self._automaton
        if automaton is None:
            return delta
        state, cut, read = self._state, self._cut, self._read
        depth, match = automaton.depth, automaton.match
        for char in delta:
            state = automaton.step(state, char)
            read += 1
            if match[state] and (cut < 0 or read - match[state] < cut):
                cut = read - match[state]
                self._cut_len = match[state]
            # A stop string yet to complete starts within the held-back tail or later: past `cut`, `cut` is final.
            if 0 <= cut <= read - depth[state]:
                return self._stop(delta, cut)
        self._state, self._cut, self._read = state, cut, read
        self._held.append(delta)
        return self._take(read - depth[state] - self._emitted)

    def flush(self) -> str:
        """Releases the held-back text when the sequence ends for another reason (cut at a stop in it)."""
        if self.stopped:
            return ""
        if self._cut >= 0:
            return self._stop("", self._cut)
        out = self._take(self._read - self._emitted)
        self._state = 0
        return out

    def _stop(self, delta: str, cut: int) -> str:
        self.stopped = True
        self._held.append(delta)
        out = self._take(cut - self._emitted)
        self.matched = self._take(self._cut_len)
        self._held.clear()
        return out

    def _take(self, count: int) -> str:
        """The next `count` held characters, now emitted."""
        self._emitted += count
        parts: list[str] = []
        held = self._held
        while count > 0:
            piece, start = held[0], self._offset
            end = start + count
            if end < len(piece):
                parts.append(piece[start:end])
                self._offset = end
                break
            parts.append(piece[start:] if start else piece)
            count -= len(piece) - start
            held.popleft()
            self._offset = 0
        return "".join(parts)
