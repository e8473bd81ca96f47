"""Prompt-lookup (n-gram) proposals: no model, just the request's own text.

For each sequence, try suffix lengths n from ``max_n`` down to ``min_n``:
find the most recent earlier occurrence of the sequence's last n tokens
(prompt and output alike) and propose the up to k tokens that followed it.
Copying, quoting, code editing and extraction repeat long spans of the
prompt, which is where this pays; when nothing matches, nothing is proposed.
Proposals are deterministic, so verification treats their draft
distribution as one-hot (``seq.spec_draft_probs`` stays None).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from common.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram range [{min_n}, {max_n}] is empty")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, items: list[tuple[Sequence, int]]) -> None:
        for seq, k in items:
            seq.spec_token_ids = lookup(np.asarray(seq.token_ids, dtype=np.int64), self.min_n, self.max_n, k)

    def retain(self, seq_ids: set[int]) -> None:
        """Stateless: nothing to free."""


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens that followed the latest earlier match of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start early enough to have at least one token after them.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
