"""Row-parallel linears (o, down) summed in one canonical order, so that tensor-parallel sizes give one another's
bits (EngineConfig.tp_reduce_chunks).

A row-parallel layer's output is a sum over its input features K. Plain tensor parallelism lets each rank sum
its slice of K, then adds the ranks' partial sums: the grouping of the additions follows tp_size, so TP 1, 2
and 3 round differently (measured on SmolLM2: TP 3 kept 3 of 8 greedy answers of TP 1, no logprob equal).

Here K is cut into `chunks` equal column chunks, a number fixed by the option and never by tp_size:
    y = ((p_0 + p_1) + p_2) + ... + p_{chunks-1},   p_c = x[:, K_c] @ W[:, K_c]^T   (one kernel call each)
A chunk's partial is one call on that chunk's blocks alone: the same bytes and the same call on whichever rank
holds the chunk, so the same bits (the int8 activations are rounded per 16-element half, which a chunk boundary
on a block boundary never cuts). Rank r of n holds chunks [r * chunks / n, (r + 1) * chunks / n); the ranks
exchange their partials and every rank adds all of them in chunk order (add_in_order, the one place the order
is fixed). TP 1 adds its own. Any tp_size dividing `chunks` then gives TP 1's bits.

Cost: `chunks / tp_size` kernel calls a layer instead of one for o and down, and the partials' exchange in
place of the all-reduce (benchmarks/tp_canonical_cost.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..kernels.quant import BLOCK_WEIGHTS, QuantWeight
from .config import ModelConfig


def add_in_order(parts: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """((parts[0] + parts[1]) + parts[2]) + ...: the one order every rank and tp size adds the partials in."""
    if len(parts) == 1:
        return parts[0].clone() if out is None else out.copy_(parts[0])
    out = torch.add(parts[0], parts[1], out=out) if out is not None else parts[0] + parts[1]
    for p in parts[2:]:
        out.add_(p)
    return out


def check_chunks(c: ModelConfig, chunks: int, name: str = "the model") -> None:
    """Refuse, before anything loads, chunks that do not cut o's and down's inputs into whole 32-weight blocks
    (the K-quants' 256-weight super-blocks are checked where the weights load: chunk_width)."""
    if chunks and c.linear_layers:
        raise ValueError(f"tp_reduce_chunks does not cover linear-attention layers yet: {name}'s Gated DeltaNet "
                         f"output would still add its ranks' sums by rank (use tp_reduce_chunks 0)")
    if chunks and c.num_experts:
        raise ValueError(f"tp_reduce_chunks does not cover expert layers yet: {name}'s experts would still add "
                         f"their ranks' sums by rank (use tp_reduce_chunks 0)")
    for what, k in (("attention output (o_proj)", c.num_heads * c.head_dim), ("MLP output (down_proj)",
                                                                              c.intermediate_size)):
        if chunks and (k % chunks or k // chunks % 32):
            raise ValueError(f"tp_reduce_chunks {chunks} does not fit {name}: its {what} has {k} input features, "
                             f"not {chunks} chunks of whole 32-weight blocks")


def chunk_width(k: int, chunks: int, weight, name: str) -> int:
    """K / chunks, checked: a chunk must hold whole quant blocks (else its blocks could not be cut out)."""
    if k % chunks:
        raise ValueError(f"tp_reduce_chunks: {chunks} chunks do not divide the {k} input features of {name}")
    width = k // chunks
    qk = BLOCK_WEIGHTS[weight.qtype] if isinstance(weight, QuantWeight) else 1
    if width % qk:
        raise ValueError(f"tp_reduce_chunks: chunks of {width} input features cut the {qk}-weight blocks of "
                         f"{name}; choose a number of chunks whose width is a multiple of {qk}")
    return width


class ChunkedRows:
    """One rank's chunks of a row-parallel linear: `lins[j]` runs the rank's j-th column chunk of the weight.
    partials(x) gives their products [chunks_here, M, N]; the caller adds every rank's in order."""

    def __init__(self, lins: list, width: int) -> None:
        self.lins, self.width = lins, width     # width: input features of a chunk

    def partials(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, chunks_here * width] -> [chunks_here, M, N] fp32 partial products."""
        w = self.width
        outs = [lin(x[:, j * w:(j + 1) * w].contiguous()) for j, lin in enumerate(self.lins)]
        return torch.stack(outs)


def chunked_rows(weight, chunks_here: int, name: str, cols: Callable, make: Callable) -> ChunkedRows:
    """A rank's row-parallel weight [N, K_rank] as chunks_here column chunks: cols(weight, a, b) cuts one,
    make(part) builds its linear."""
    k = weight.k if isinstance(weight, QuantWeight) else weight.shape[1]
    width = chunk_width(k, chunks_here, weight, name)
    return ChunkedRows([make(cols(weight, j * width, (j + 1) * width)) for j in range(chunks_here)], width)
