"""Stop strings matched on text, holding back what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feeds text deltas through; cuts the output at the first stop string.

    It holds back the longest tail of the text that is a prefix of some stop string, so a stop
    string split across several tokens is still found and never shown to the client. The result
    does not depend on how the text was split: a complete stop string waits while a longer one that
    starts earlier may still complete (stops "b" and "ab": "a" + "b" cuts before "a", as "ab" does).
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        text = self._held + delta
        cut = self._first_match(text)
        pending = len(text) - self._partial_tail(text)  # where a stop string may be starting
        if cut >= 0 and pending >= cut:
            self.stopped = True
            self._held = ""
            return text[:cut]
        self._held = text[pending:]
        return text[:pending]

    def flush(self) -> str:
        """Releases the held-back text when the sequence ends for another reason (cut at a stop in it)."""
        held, self._held = self._held, ""
        if self.stopped:
            return ""
        cut = self._first_match(held)
        if cut >= 0:
            self.stopped = True
            return held[:cut]
        return held

    def _first_match(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)

    def _partial_tail(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
