"""How many torch threads a step uses on a CPU: one for a step of a token or two, all of them for more."""

from __future__ import annotations

import torch


class IntraOpThreads:
    """Sets torch's intra-op threads before each step, by the tokens it computes.

    A step of one or two rows gains nothing from a second thread (its matrices are too small to split), and over
    HTTP that thread takes a core from the event loop and the engine's own Python: on the 2-core machine a single
    stream got 25 tokens/s with two threads and 31 with one, while 16 streams kept their 250 with two. Call it on
    the thread that runs the model: the setting is that thread's.

    Args:
        most: the threads a large step uses (--torch-threads, or torch's default).
        small: steps of at most this many tokens use one thread.
    """

    def __init__(self, most: int, small: int = 2) -> None:
        self.most = most
        self.small = small
        self._current = torch.get_num_threads()

    def fit(self, tokens: int) -> None:
        want = 1 if tokens <= self.small else self.most
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want
