"""N-gram prompt lookup: the draft is what followed the latest earlier occurrence of a row's last few tokens.

No model runs: a row that copies (code rewritten with a small change, a quoted passage) finds the text it is
copying in its own prompt or output, and the target model verifies the proposal in its next forward.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes up to `k` tokens for a token history, matching its last `n_max` .. `n_min` tokens (longest first)."""

    def __init__(self, k: int, n_max: int, n_min: int) -> None:
        self.k = k
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, tokens: np.ndarray, limit: int) -> list[int]:
        """At most `min(k, limit)` tokens that followed the latest earlier occurrence of the history's last n
        tokens (the longest n that occurs; of its occurrences, the latest followed by that many tokens, if any);
        [] when none does. `tokens`: the prompt and output so far, int64."""
        most = min(self.k, limit)
        total = len(tokens)
        if most <= 0:
            return []
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            # Windows starting before the suffix itself, each followed by at least one token.
            windows = sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if hits.size:
                # The latest occurrence followed by a whole draft, else the latest one.
                whole = hits[hits + n + most <= total]
                start = int(whole[-1] if whole.size else hits[-1]) + n
                return [int(t) for t in tokens[start : start + most]]
        return []
