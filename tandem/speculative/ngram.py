"""The n-gram proposer (prompt lookup): no extra model, drafts are copied from the request's own text.

The longest suffix of prompt + output (prompt_lookup_max down to prompt_lookup_min tokens) that occurs earlier
in the same text proposes the tokens that followed its most recent earlier occurrence (at most k). Quoting,
editing and multi-turn chats that refer back repeat their input, so those drafts are often right.
"""
from __future__ import annotations

from typing import Sequence

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


class NgramIndex:
    """propose_ngram's rule over one request's text, kept up to date as the text grows.

    The text is host truth (prompt + outputs: append-only, tandem/request.py) plus a tail the overlap loop only
    assumes (Req.spec.guess, rewritten or dropped at every step). Truth's windows enter per-n dicts (n-gram ->
    start of its most recent occurrence) once a token follows them; the few windows that end inside the assumed
    tail are more recent than all of those and are scanned first. Memory: one dict entry per token and n
    (~0.5 KB a token at n = 1..4; a token's bf16 KV on SmolLM2 is 23 KB)."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lo, self.hi = lookup_min, lookup_max
        self.latest: list[dict[tuple, int]] = [{} for _ in range(lookup_max - lookup_min + 1)]
        self.text: list[int] = []           # host truth so far (the parts' tokens, joined)
        self.upto = 0                       # windows ending at or before this position are in `latest`

    def _grow(self, parts: Sequence[Sequence[int]]) -> None:
        """Take truth's new tokens (parts joined: prompt, outputs) and index the windows a token now follows."""
        have = len(self.text)
        if sum(len(p) for p in parts) < have:      # truth shrank (never, by request.py's rule): start again
            self.__init__(self.lo, self.hi)
            have = 0
        off = 0
        for p in parts:
            if off + len(p) > have:
                self.text.extend(p[max(have - off, 0):])
            off += len(p)
        text = self.text
        for e in range(self.upto + 1, len(text)):     # a window ending at e is followed by text[e]
            for n in range(self.lo, min(self.hi, e) + 1):
                self.latest[n - self.lo][tuple(text[e - n:e])] = e - n
            self.upto = e

    def propose(self, parts: Sequence[Sequence[int]], tail: Sequence[int], k: int) -> list[int]:
        """propose_ngram(truth + tail, k, lookup_min, lookup_max), truth being the parts joined (append-only)."""
        self._grow(parts)
        truth = self.text
        t, n_all = len(truth), len(truth) + len(tail)

        def at(i: int, j: int) -> list[int]:            # (truth + tail)[i:j]
            return truth[i:min(j, t)] + list(tail[max(i - t, 0):max(j - t, 0)])
        if k < 1 or n_all < self.lo + 1:
            return []
        for n in range(min(self.hi, n_all - 1), self.lo - 1, -1):
            suffix = at(n_all - n, n_all)
            for e in range(n_all - 1, max(self.upto, n - 1), -1):     # windows ending in the tail: most recent
                if at(e - n, e) == suffix:
                    return at(e, e + k)
            start = self.latest[n - self.lo].get(tuple(suffix))
            if start is not None:
                return at(start + n, start + n + k)
        return []
