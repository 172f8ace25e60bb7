"""The shared-memory buffers between the ProcessExecutor (process/executor.py, in the scheduler's process) and
the device process (process/main.py): a step's index arrays go in, sampled ids, logprobs and grammar masks go
through them, in one file in /dev/shm, so a launch is only a short socket message."""
from __future__ import annotations

import numpy as np

from ... import runtime_files
from ...sampler import MAX_LOGPROBS


class SharedBuffers:
    """`slots` slots (2; pp_size under the PP loop) each of step input (int64 + float64), sampled ids, logprobs,
    and grammar token masks (int32 rows of mask_width words), in one file in /dev/shm.

    Out slot of a step of B rows: ints [B sampled ids | B x MAX_LOGPROBS top ids], floats [B chosen logprobs |
    B x MAX_LOGPROBS top logprobs] (the logprob parts written only when a row asked for them); embeddings
    float32 [E x hidden] (the step's embeddings rows' pooled vectors, device/embed.py; emb_floats of room)."""

    def __init__(self, path: str, int_words: int, float_words: int, out_words: int, mask_rows: int,
                 mask_width: int, create: bool, slots: int = 2, emb_floats: int = 0) -> None:
        self.sizes = (int_words, float_words, out_words, mask_rows, mask_width, slots, emb_floats)
        self.slots = slots
        mask_words = (mask_rows * mask_width + 1) // 2
        emb_words = (emb_floats + 1) // 2
        nbytes = 8 * slots * (int_words + float_words + 2 * out_words + mask_words + emb_words)
        self._map = runtime_files.map_file(path, nbytes, create)
        o = 0
        self.ints, self.floats, self.outs, self.lp_outs = [], [], [], []
        for lst, words, dt in ((self.ints, int_words, np.int64), (self.floats, float_words, np.float64),
                               (self.outs, out_words, np.int64), (self.lp_outs, out_words, np.float64)):
            for _ in range(slots):
                lst.append(np.frombuffer(self._map, dtype=dt, count=words, offset=o))
                o += 8 * words
        self.masks = []
        for _ in range(slots):
            self.masks.append(np.frombuffer(self._map, dtype=np.int32, count=mask_rows * mask_width, offset=o)
                              .reshape(mask_rows, mask_width))
            o += 8 * mask_words
        self.emb_outs = []
        for _ in range(slots):
            self.emb_outs.append(np.frombuffer(self._map, dtype=np.float32, count=emb_floats, offset=o))
            o += 8 * emb_words


def write_logprobs(ints: np.ndarray, floats: np.ndarray, n: int, lp) -> None:
    """n entries: floats [n chosen | n x MAX_LOGPROBS top], ints [n | n x MAX_LOGPROBS top ids] (ints[:n] unused
    for the sampled rows' part: those hold the sampled ids)."""
    k = lp.top.shape[1]
    floats[:n] = lp.chosen.cpu().numpy()
    ints[n:n + n * MAX_LOGPROBS].reshape(n, MAX_LOGPROBS)[:, :k] = lp.top_ids.cpu().numpy()
    floats[n:n + n * MAX_LOGPROBS].reshape(n, MAX_LOGPROBS)[:, :k] = lp.top.cpu().numpy()


def write_results(outs: np.ndarray, lp_outs: np.ndarray, b: int, tokens, lp, plp,
                  emb_outs: np.ndarray | None = None, emb=None) -> None:
    """A step's out slot: the sampled ids of its b rows, their logprobs and the prompt positions' (each where
    some row asked for them), and the embeddings rows' vectors (emb [E, H], where some row is one)."""
    outs[:b] = tokens.cpu().numpy()
    if emb is not None:
        emb_outs[:emb.numel()] = emb.cpu().numpy().ravel()
    for x, o in ((lp, 0), (plp, b * (1 + MAX_LOGPROBS))):
        if x is not None:
            write_logprobs(outs[o:], lp_outs[o:], len(x.chosen), x)


def read_logprobs(ints: np.ndarray, floats: np.ndarray, n: int, k: int) -> tuple:
    return (floats[:n].copy(), ints[n:n + n * MAX_LOGPROBS].reshape(n, MAX_LOGPROBS)[:, :k].copy(),
            floats[n:n + n * MAX_LOGPROBS].reshape(n, MAX_LOGPROBS)[:, :k].copy())
