"""A step's packed words on the wire between device ranks: the tp step broadcast (tp.py) and, for pipeline
stages on another machine (parallel/pp_stage.py), the step forwarded stage to stage. One layout for both.

A message is [header | up to INLINE payload words] in one transfer and the rest of a longer payload (a
prefill) in a second: each gloo call costs ~0.2 ms on loopback, and a decode step of 64 rows is ~1,550 words.
Header: kind, step id, int words, float words, extra words (tp: the previous step's sampled rows), payload
words. The payload is the step's ints, its floats viewed as int64, then the extra words.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..step import StepInput

QUIT, STEP, NOOP, PROBE = 0, 1, 2, 3   # PROBE: tp's liveness round trip (TPGroup.probe)
KEEPALIVE_S = 60.0          # an idle sender (tp rank 0, pp's last node-0 stage) sends a NOOP this often
HEADER = 6
INLINE = 2048


def send_words(xfer: Callable[[torch.Tensor], None], device, kind: int, step_id: int = 0,
               payload: np.ndarray | None = None, words=(0, 0, 0)) -> None:
    """Send one message through `xfer` (a broadcast from this rank, or a send to the next stage)."""
    n = 0 if payload is None else len(payload)
    msg = np.zeros(HEADER + INLINE, np.int64)
    msg[:HEADER] = (kind, step_id, *words, n)
    if n:
        msg[HEADER:HEADER + min(n, INLINE)] = payload[:INLINE]
    xfer(torch.from_numpy(msg).to(device))
    if n > INLINE:
        xfer(torch.from_numpy(np.ascontiguousarray(payload[INLINE:])).to(device))


def step_payload(step: StepInput, ints: np.ndarray, floats: np.ndarray,
                 extra: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(payload, (int words, float words, extra words)) of a packed step."""
    ni, nf = step.int_words(), step.float_words()
    parts = [ints[:ni], floats[:nf].view(np.int64)] + ([] if extra is None else [extra])
    return np.concatenate(parts), (ni, nf, 0 if extra is None else len(extra))


def recv_words(xfer: Callable[[torch.Tensor], torch.Tensor],
               device) -> tuple[int, int, StepInput | None, np.ndarray, np.ndarray, np.ndarray]:
    """One message through `xfer` (fills the tensor it is given): (kind, step id, the step or None, its ints,
    its floats, the extra words)."""
    msg = xfer(torch.zeros(HEADER + INLINE, dtype=torch.int64, device=device)).cpu().numpy()
    kind, step_id, ni, nf, _, n = msg[:HEADER].tolist()
    if kind != STEP:
        return kind, step_id, None, *(np.zeros(0, np.int64),) * 3
    words = msg[HEADER:HEADER + n]
    if n > INLINE:
        rest = xfer(torch.empty(n - INLINE, dtype=torch.int64, device=device)).cpu().numpy()
        words = np.concatenate([words, rest])
    ints, floats = words[:ni], words[ni:ni + nf].view(np.float64)
    return kind, step_id, StepInput.unpack(step_id, ints, floats), ints, floats, words[ni + nf:]


class WireControl:
    """keepalive and quit of a group whose `_control(kind)` sends a no-op or the quit down its wire (tp's step
    broadcast, pp's step passing to another node)."""

    def _control(self, kind: int) -> None:
        raise NotImplementedError

    def keepalive(self) -> None:
        self._control(NOOP)

    def quit(self, quiet: bool = False) -> None:
        """Tell the other ranks to exit (quiet: on the way out anyway, a dead peer is no news)."""
        try:
            self._control(QUIT)
        except RuntimeError:
            if not quiet:
                raise
