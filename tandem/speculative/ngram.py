"""The n-gram proposer (prompt lookup): no extra model, drafts are copied from the request's own text.

The longest suffix of prompt + output (prompt_lookup_max down to prompt_lookup_min tokens) that occurs earlier
in the same text proposes the tokens that followed its most recent earlier occurrence (at most k). Quoting,
editing and multi-turn chats that refer back repeat their input, so those drafts are often right.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k draft tokens to follow `tokens` (empty when no suffix of lookup_min..lookup_max tokens repeats)."""
    n_all = len(tokens)
    if k < 1 or n_all < lookup_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(lookup_max, n_all - 1), lookup_min - 1, -1):
        suffix = arr[n_all - n:]
        # Windows starting at 0 .. n_all - n - 1: every earlier occurrence (the suffix itself excluded), each
        # followed by at least one token.
        windows = sliding_window_view(arr[:n_all - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n            # the most recent occurrence: what followed it
            return arr[start:start + k].tolist()
    return []
