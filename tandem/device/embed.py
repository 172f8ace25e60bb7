"""Embeddings: the pooled hidden state a step returns for each of its embeddings rows (StepInput.embed).

StepInput.embed holds flags per batch row: OUT, the vector comes back with this step's results (the request's last
prefill chunk); MEAN, the row's positions add to its request-table row's running sum; RESET, that sum starts at zero
(the chunk starts at position 0). 0 for every other row.

`last` pooling: a row's last token's final-normed hidden state, the row the LM head reads to sample, taken on the
request's last prefill chunk (so chunked prefill and prefix-cache hits change nothing: the last token is always
computed).

`mean` pooling: the mean over every prompt position of the final-normed hidden state. The request skips the prefix
cache match (memory/kv_manager.py), so every position is computed, over one or several prefill chunks; the device
keeps a float64 sum per request-table row (`sums`, the model runner's), adds each chunk's rows to it and divides by
the prompt length at the last chunk. Batch invariance: the sum adds the positions in position order, one at a time
(sum += h[p] for p = 0, 1, ...; never a reduction whose grouping follows the chunk size or the batch), so a vector
is the same bits whatever the chunking and the batch mates. A retracted or aborted request's sum never leaks into
another: its row's next mean request restarts it (RESET) and any other row that runs there drops it.

The device returns the vectors raw (float32); the host L2-normalizes them one at a time, so a vector's bits never
depend on its batch mates.
"""
from __future__ import annotations

import math

import numpy as np
import torch

OUT, MEAN, RESET = 1, 2, 4
POOLINGS = ("last", "mean")


def flags(params, start: int, last: bool) -> int:
    """StepInput.embed of a prefill chunk [start, ...) of a request with these SamplingParams."""
    if not params.embed:
        return 0
    if params.pooling != "mean":
        return OUT if last else 0
    return MEAN | (RESET if start == 0 else 0) | (OUT if last else 0)


def _mean_rows(step) -> np.ndarray:
    return np.nonzero(step.embed & MEAN)[0]


def mean_index(step, index: torch.Tensor) -> torch.Tensor:
    """The flat token indices the final hidden states are taken at (index: the rows' last tokens and the prompt
    logprob positions), then every position of each MEAN row, rows in batch order, positions ascending."""
    rows = _mean_rows(step)
    if not len(rows):
        return index
    starts = np.cumsum(step.extend_lens) - step.extend_lens
    flat = np.concatenate([np.arange(starts[i], starts[i] + step.extend_lens[i]) for i in rows])
    return torch.cat([index, torch.from_numpy(flat).to(index.device)])


def _accumulate(step, hidden: torch.Tensor, sums: dict) -> None:
    """Add each MEAN row's positions (hidden's last rows, laid out as mean_index) to its row's sum, one position
    at a time in position order (the batch-invariance rule above); drop the stale sum of a row that runs without."""
    rows = _mean_rows(step)
    if sums:
        for row in set(step.rows[(step.embed & MEAN) == 0].tolist()) & set(sums):
            del sums[row]            # a finished, retracted or aborted request's row, reused by another request
    o = hidden.shape[0] - int(step.extend_lens[rows].sum())
    for i in rows:
        row, n = int(step.rows[i]), int(step.extend_lens[i])
        if step.embed[i] & RESET:
            sums[row] = torch.zeros(hidden.shape[1], dtype=torch.float64, device=hidden.device)
        acc = sums.get(row)
        if acc is None:
            raise RuntimeError("mean pooling: a chunk past position 0 without the row's earlier chunks (a prefix-cache "
                               "hit would skip them)")
        for h in hidden[o:o + n].unbind(0):
            acc += h                 # float64 += float32: exact widening, one position at a time
        o += n


def pooled(step, hidden: torch.Tensor, sums: dict) -> torch.Tensor | None:
    """hidden [B + N, H] (each row's last token, final-normed, then the positions mean_index added) -> [E, H]
    float32 at the OUT rows, in batch order; None where none is. sums: row -> float64 [H], the mean rows' sums."""
    if (step.embed & MEAN).any() or sums:
        _accumulate(step, hidden, sums)
    rows = np.nonzero(step.embed & OUT)[0]
    if not len(rows):
        return None
    out = []
    for i in rows.tolist():
        if step.embed[i] & MEAN:     # the last chunk: every position 0..seq_lens - 1 is in the sum
            out.append((sums.pop(int(step.rows[i])) / int(step.seq_lens[i])).float())
        else:
            out.append(hidden[i].float())
    return torch.stack(out)


def normalized(vector: np.ndarray) -> bytes:
    """One vector [H], L2-normalized, as little-endian float32 bytes (OpenAI's base64 payload); an all-zero
    vector stays zero. The norm is an exactly rounded sum (math.fsum): no BLAS order or alignment in it."""
    v = vector.astype(np.float64)
    norm = math.sqrt(math.fsum(v * v))
    return (v / norm if norm > 0 else v).astype("<f4").tobytes()


def vector(data: bytes) -> list[float]:
    """The floats of normalized()'s bytes."""
    return np.frombuffer(data, "<f4").tolist()
