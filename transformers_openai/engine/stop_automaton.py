"""An Aho-Corasick automaton over a request's stop strings, built once per request and read one character at a time."""

from __future__ import annotations

from array import array
from collections import deque

_NONE = "\0"  # the label of a node without children (never compared: its `first` is 0)


class StopAutomaton:
    """The trie of the stop strings with failure links.

    A state is a trie node: the longest suffix of the text read so far that is a prefix of some stop string. Reading a
    character costs O(1) amortized whatever the stop strings' lengths (each failure link taken shortens the state by
    at least one, and each character lengthens it by at most one). Building it costs O(total length of the stops).

    Long stop strings are mostly chains of one child each, so a node keeps its first child in flat arrays (about 35
    bytes a node) and only a node with several children a dict of the others.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        labels: list[str] = [_NONE]  # per node: the character to its first child
        first = [0]  # per node: its first child, 0 where it has none (the root is nobody's child)
        others: dict[int, dict[str, int]] = {}
        own = [0]  # per node: the length of the stop string ending exactly there, 0 where none does
        for stop in stops:
            node, at = 0, 0
            while at < len(stop):  # down the part of the trie that is there already
                char = stop[at]
                if first[node] and labels[node] == char:
                    child = first[node]
                else:
                    child = others.get(node, {}).get(char, 0)
                    if not child:
                        break
                node, at = child, at + 1
            if at < len(stop):  # the rest is a new chain of consecutive nodes
                start, rest = len(first), stop[at:]
                if first[node]:
                    others.setdefault(node, {})[rest[0]] = start
                else:
                    labels[node], first[node] = rest[0], start
                labels.extend(rest[1:])
                labels.append(_NONE)
                first.extend(range(start + 1, start + len(rest)))
                first.append(0)
                own.extend(bytes(len(rest)))
                node = len(first) - 1
            own[node] = len(stop)
        self._labels = "".join(labels)
        self._first = array("l", first)
        self._others = others
        self.depth = array("l", bytes(8 * len(first)))
        self._fail = array("l", bytes(8 * len(first)))
        # Per node: the longest stop string that is a suffix of its text (0 where none is), the earliest match ending
        # there.
        self.match = array("l", own)
        self._link()

    def _link(self) -> None:
        labels, first, others = self._labels, self._first, self._others
        depth, fail, match, step = self.depth, self._fail, self.match, self.step
        queue: deque[int] = deque([0])
        while queue:  # breadth first: a node's failure link is shorter than it, so already linked
            node = queue.popleft()
            children = [(labels[node], first[node])] if first[node] else []
            if node in others:
                children.extend(others[node].items())
            below, back_of_node = depth[node] + 1, fail[node]
            for char, child in children:
                depth[child] = below
                back = step(back_of_node, char) if node else 0
                fail[child] = back
                if not match[child]:
                    match[child] = match[back]
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        """The state after reading `char` in `state`."""
        labels, first, others, fail = self._labels, self._first, self._others, self._fail
        while True:
            if labels[state] == char and first[state]:
                return first[state]
            more = others.get(state)
            if more is not None and char in more:
                return more[char]
            if not state:
                return 0
            state = fail[state]
