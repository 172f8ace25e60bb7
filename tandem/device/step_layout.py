"""A step's token layout, worked out on the host from its index arrays: the batch row of each token, each row's
first token and each token's position. These are a few integers a row; as torch ops on a CPU device each of the
~15 repeat_interleave / cumsum / arange / index calls that made them cost 3-25 us of dispatch (a batch-1 decode
step spent ~0.4 ms preparing its inputs), in numpy ~1 us. They reach the device as index tensors like the rest
of the step (ModelRunner._tensor), as vLLM's input batch prepares positions on the host."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenLayout:
    tok_row: np.ndarray     # [T] batch row of each token (rows' tokens one after another)
    starts: np.ndarray      # [B] flat index of each row's first token
    positions: np.ndarray   # [T] each token's position in its request (its row's KV length before it, counted on)
    last: np.ndarray        # [B] flat index of each row's last token
    one_each: bool          # every row one token (a pure decode step): tok_row = starts = last = arange(B)

    def token_cols(self) -> np.ndarray:
        """[T] each token's index within its row."""
        return np.arange(len(self.tok_row)) - self.starts[self.tok_row]


def token_layout(extend_lens: np.ndarray, seq_lens: np.ndarray) -> TokenLayout:
    """The layout of rows of extend_lens new tokens each, whose KV lengths after the step are seq_lens."""
    b = len(extend_lens)
    if bool((extend_lens == 1).all()):
        rows = np.arange(b)
        return TokenLayout(rows, rows, seq_lens - 1, rows, True)
    tok_row = np.repeat(np.arange(b), extend_lens)
    ends = np.cumsum(extend_lens)
    starts = ends - extend_lens
    positions = (seq_lens - extend_lens)[tok_row] + np.arange(len(tok_row)) - starts[tok_row]
    return TokenLayout(tok_row, starts, positions, ends - 1, False)


def decode_split(seq_lens: np.ndarray) -> list[int]:
    """Where to cut decode rows (sorted by length) in two groups, if that saves over half the padded keys."""
    n = len(seq_lens)
    if n < 2:
        return []
    cost = np.arange(1, n) * seq_lens[:-1] + (n - np.arange(1, n)) * seq_lens[-1]     # cut before row i
    i = int(np.argmin(cost))
    return [i + 1] if 2 * cost[i] < n * seq_lens[-1] else []


def row_groups(extend_lens: np.ndarray, seq_lens: np.ndarray) -> tuple[int, list[tuple[int, int]]]:
    """The step's attention groups of rows [lo, hi): its leading one-token (decode) rows, cut in two where
    decode_split says, then the rest. Returns (the number of leading decode rows, the groups)."""
    b = len(extend_lens)
    nd = int(np.argmin(extend_lens == 1)) if (extend_lens != 1).any() else b
    bounds = [0] + decode_split(seq_lens[:nd]) + [nd, b]
    return nd, [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
