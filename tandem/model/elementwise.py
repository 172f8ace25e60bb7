"""Elementwise transcendental ops whose every value is the same bits wherever it sits in a step's tensor: the batch
invariance attention_paths.py states, for the torch ops the hybrid layers (linear_attention.py) and the shared
expert's gate (moe.py) run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

LANES = 64      # elementwise ops run on rows padded to a multiple of this many values (elementwise())


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (exp, sigmoid, silu, softplus: not correctly rounded) on x [..., W], each value the same bits whatever
    the tensor's length: torch's vectorized loop computes its tail (past the last whole vector) by a scalar form that
    rounds differently, so a value's bits would follow its place in the step. Rows padded to LANES values have no
    tail."""
    pad = -x.shape[-1] % LANES
    if pad == 0:
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., :x.shape[-1]]
