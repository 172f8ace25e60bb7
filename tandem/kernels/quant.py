"""Weights kept as GGUF blocks, the quantized linear over them, and the torch reference of both.

A QuantWeight is the GGUF's own bytes, one row of blocks per output feature (see csrc/quant_gemm.cpp for
the block formats). Rows are whole blocks along K, so permuting or concatenating rows (llama's q/k
un-permutation, the fused qkv and gate_up) works on the bytes as on a dense matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Q4_0, Q4_1, Q8_0 = 2, 3, 8                           # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}         # per 32 weights
NATIVE_QTYPES = frozenset(BLOCK_BYTES)
# Rows of x up to which the in-kernel GEMM runs; past it the layer is dequantized and MKL's fp32 GEMM
# takes over (its blocking wins on many rows; the dequantization is then a small part of the work).
SMALL_M = 64


@dataclass(frozen=True)
class QuantWeight:
    data: torch.Tensor          # uint8 [N, K / 32 * BLOCK_BYTES[qtype]]
    qtype: int
    k: int                      # input features

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)

    def numel(self) -> int:
        return self.data.shape[0] * self.k

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], by the native op where it is loaded."""
        from . import available
        if available():
            return torch.ops.tandem.dequantize(self.data, self.qtype, self.k)
        return dequantize_ref(self.data, self.qtype, self.k)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows [len(index), K] (an embedding lookup without a dense table)."""
        return torch.ops.tandem.dequantize(self.data[index], self.qtype, self.k)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight | None":
        """Rows of several weights stacked (None when their types or K differ)."""
        if len({(p.qtype, p.k) for p in parts}) != 1:
            return None
        return QuantWeight(torch.cat([p.data for p in parts]).contiguous(), parts[0].qtype, parts[0].k)


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ dequant(w)^T (+ bias) -> [M, N]."""
    if x.shape[0] <= SMALL_M:
        return torch.ops.tandem.qlinear(x, w.data, w.qtype, w.k, bias)
    return F.linear(x, w.dequantize(), bias)


# ---------------------------------------------------------------------------------------- torch reference
def dequantize_ref(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """fp32 [N, K] from GGUF blocks, in torch ops (the specification the native op is tested against)."""
    n = data.shape[0]
    b = data.view(n, k // 32, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()         # [N, nb, 1]
    if qtype == Q8_0:
        return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, k)
    qs = b[..., 4:] if qtype == Q4_1 else b[..., 2:]                  # [N, nb, 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()                 # element i<16: low nibble of byte i
    if qtype == Q4_0:
        return (d * (q - 8)).reshape(n, k)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, k)


def qlinear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_ref(w.data, w.qtype, w.k), bias)
