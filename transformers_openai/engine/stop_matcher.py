"""Stop strings matched on text, holding back what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feeds text deltas through; cuts the output at the first stop string.

    It holds back the longest tail of the text that is a prefix of some stop string, so a stop
    string split across several tokens is still found and never shown to the client.
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
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        hold = self._partial_tail(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Releases the held-back text when the sequence ends for another reason."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
