"""Weights kept as GGUF blocks, the quantized linear over them, and the torch reference of both.

A QuantWeight holds the GGUF's own bytes, one row per output feature, regrouped within the row (same size):
    row = [d fp16 x nb][m fp16 x nb, Q4_1 only][quants x nb: 16 bytes of nibbles (Q4), 32 int8 (Q8)]
nb = K / 32 blocks. Scales apart from quants let a kernel convert 16 scales in one instruction and
broadcast them from memory (measured: the per-block fp16 scale handling of the interleaved GGUF layout kept
the AVX-512 decode kernel on one execution port). K-quants (256-weight super-blocks): Q6_K rows keep the
GGUF's bytes; Q4_K rows are regrouped (same size) as [16-byte super-block headers][quants, 16 bytes a
32-weight sub-block in Q4_0's nibble order], so the kernels treat a sub-block as a Q4_1 block (measured: the
GGUF's order, two sub-blocks sharing 32 bytes, cost 1.6x Q4_1's time per weight). Their 6-bit / int8
sub-block scales are decoded once per row and call.
Rows are whole blocks along K, so permuting or concatenating rows (llama's q/k un-permutation, the fused qkv
and gate_up) works on the bytes as on a dense matrix. See csrc/quant_gemm.cpp for the block formats.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14       # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q6_K: 210}   # per block
BLOCK_WEIGHTS = {Q4_0: 32, Q4_1: 32, Q8_0: 32, Q4_K: 256, Q6_K: 256}  # weights along K per block
K_QUANTS = frozenset({Q4_K, Q6_K})
INT8_ACT_QTYPES = frozenset({Q4_0, Q4_1, Q8_0})       # what tandem.qlinear_q8 reads (kernels_act="int8")
NATIVE_QTYPES = frozenset(BLOCK_BYTES)
# Rows of x up to which the in-kernel GEMM runs (measured: 1.4x the fp32 GEMM at 65 rows, even at 128);
# past it the layer is dequantized into a reused buffer and MKL's fp32 GEMM
# takes over (its blocking wins on many rows; the dequantization is then a small part of the work).
SMALL_M = 96
# The AVX2 body has half the registers and lanes: measured with it forced on this machine, it beat the fp32
# GEMM at 8 rows (1.3x) and lost at 64 (0.5x).
SMALL_M_AVX2 = 16


@dataclass(frozen=True)
class QuantWeight:
    data: torch.Tensor          # uint8 [N, K / BLOCK_WEIGHTS * BLOCK_BYTES], rows regrouped (module docstring)
    qtype: int
    k: int                      # input features

    @staticmethod
    def from_gguf(blocks: torch.Tensor, qtype: int, k: int) -> "QuantWeight":
        """From GGUF rows of interleaved blocks, uint8 [N, K / block weights * block bytes]."""
        if qtype == Q6_K:
            return QuantWeight(blocks.contiguous(), qtype, k)
        if qtype == Q4_K:
            return QuantWeight(_q4_k_regroup(blocks, k), qtype, k)
        n, nb = blocks.shape[0], k // 32
        b = blocks.reshape(n, nb, BLOCK_BYTES[qtype])
        scales = 4 if qtype == Q4_1 else 2
        parts = [b[..., i:i + 2].reshape(n, -1) for i in range(0, scales, 2)] + [b[..., scales:].reshape(n, -1)]
        return QuantWeight(torch.cat(parts, dim=1).contiguous(), qtype, k)

    def to_gguf(self) -> torch.Tensor:
        """The GGUF rows back (interleaved blocks)."""
        if self.qtype == Q6_K:
            return self.data
        if self.qtype == Q4_K:
            return _q4_k_ungroup(self.data, self.k)
        n, nb = self.data.shape[0], self.k // 32
        scales = 4 if self.qtype == Q4_1 else 2
        s = self.data[:, :scales * nb].reshape(n, scales // 2, nb, 2).transpose(1, 2).reshape(n, nb, scales)
        q = self.data[:, scales * nb:].reshape(n, nb, -1)
        return torch.cat([s, q], dim=2).reshape(n, -1).contiguous()

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


_scratch = torch.empty(0)      # reused fp32 buffer of the prefill path (one forward runs at a time)
_small_m: int | None = None


def small_m() -> int:
    """Rows up to which qlinear runs in-kernel on this CPU."""
    global _small_m
    if _small_m is None:
        _small_m = SMALL_M if torch.ops.tandem.isa(-1) == 2 else SMALL_M_AVX2
    return _small_m


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, int8_act: bool = False
            ) -> torch.Tensor:
    """x [M, K] fp32 @ dequant(w)^T (+ bias) -> [M, N]. int8_act: rows of x quantized to int8 blocks first
    (in-kernel rows and INT8_ACT_QTYPES only; prefill and other types keep fp32 activations)."""
    global _scratch
    if x.shape[0] <= small_m():
        if int8_act and w.qtype in INT8_ACT_QTYPES:
            return torch.ops.tandem.qlinear_q8(x, w.data, w.qtype, w.k, bias)
        return torch.ops.tandem.qlinear(x, w.data, w.qtype, w.k, bias)
    if _scratch.numel() < w.numel():
        _scratch = torch.empty(w.numel())
    dense = _scratch[:w.numel()].view(w.shape)
    torch.ops.tandem.dequantize_out(w.data, w.qtype, w.k, dense)
    return F.linear(x, dense, bias)


# ---------------------------------------------------------------------------------------- torch reference
def dequantize_ref(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """fp32 [N, K] from QuantWeight rows, in torch ops (the specification the native op is tested against)."""
    if qtype in K_QUANTS:
        return _dequantize_k_ref(_q4_k_ungroup(data, k) if qtype == Q4_K else data, qtype, k)
    n, nb = data.shape[0], k // 32
    d = data[:, :2 * nb].contiguous().view(torch.float16).float()[..., None]     # [N, nb, 1]
    if qtype == Q8_0:
        return (d * data[:, 2 * nb:].contiguous().view(torch.int8).float().view(n, nb, 32)).reshape(n, k)
    qs = data[:, (4 if qtype == Q4_1 else 2) * nb:].reshape(n, nb, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()                 # element i<16: low nibble of byte i
    if qtype == Q4_0:
        return (d * (q - 8)).reshape(n, k)
    m = data[:, 2 * nb:4 * nb].contiguous().view(torch.float16).float()[..., None]
    return (d * q + m).reshape(n, k)


def qlinear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_ref(w.data, w.qtype, w.k), bias)


def _q4_k_regroup(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q4_K rows -> [headers (d, dmin, scales: 16 bytes) x ns][qs: 16 bytes a sub-block, element i < 16 the
    low nibble of byte i, i >= 16 the high nibble of byte i - 16]. GGUF: sub-blocks 2c, 2c + 1 are the low and
    high nibbles of the same 32 bytes."""
    n, ns = blocks.shape[0], k // 256
    b = blocks.reshape(n, ns, 144)
    q = b[..., 16:].reshape(n, ns, 4, 32)
    sub = torch.stack([q & 15, q >> 4], dim=3).reshape(n, ns * 8, 32)               # [n, nb, 32] one nibble a byte
    qs = sub[..., :16] | (sub[..., 16:] << 4)
    return torch.cat([b[..., :16].reshape(n, -1), qs.reshape(n, -1)], dim=1).contiguous()


def _q4_k_ungroup(data: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of _q4_k_regroup: GGUF Q4_K rows."""
    n, ns = data.shape[0], k // 256
    head = data[:, :16 * ns].reshape(n, ns, 16)
    qs = data[:, 16 * ns:].reshape(n, ns, 8, 16)
    sub = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, ns, 4, 2, 32)            # [.., chunk, low/high, 32]
    q = sub[..., 0, :] | (sub[..., 1, :] << 4)
    return torch.cat([head, q.reshape(n, ns, 128)], dim=-1).reshape(n, -1).contiguous()


def _half(b: torch.Tensor) -> torch.Tensor:
    """fp32 of little-endian fp16 bytes [..., 2]."""
    return b.contiguous().view(torch.float16).float()


def _dequantize_k_ref(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Q4_K / Q6_K super-blocks (GGUF layout, csrc/quant_gemm.cpp) -> fp32 [N, K]."""
    n, ns = data.shape[0], k // 256
    b = data.reshape(n, ns, BLOCK_BYTES[qtype]).int()
    if qtype == Q4_K:
        d, dmin, s = _half(data.reshape(n, ns, 144)[..., 0:2]), _half(data.reshape(n, ns, 144)[..., 2:4]), b[..., 4:16]
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)      # [n, ns, 8]
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
        qs = b[..., 16:].reshape(n, ns, 4, 1, 32)
        q = ((qs >> torch.tensor([0, 4]).view(1, 1, 1, 2, 1)) & 15).reshape(n, ns, 8, 32).float()
        return ((d * sc.float())[..., None] * q - (dmin * mn.float())[..., None]).reshape(n, k)
    ql, qh = b[..., :128].reshape(n, ns, 2, 1, 64), b[..., 128:192].reshape(n, ns, 2, 1, 32)
    lo = (ql >> torch.tensor([0, 4]).view(1, 1, 1, 2, 1)) & 15                      # [n, ns, 2, 2, 64]
    hi = (qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)) & 3                  # [n, ns, 2, 4, 32]
    q = (lo.reshape(n, ns, 2, 4, 32) | (hi << 4)) - 32                               # element 128h + 32t + l
    scales = data.reshape(n, ns, 210)[..., 192:208].contiguous().view(torch.int8).float()   # [n, ns, 16]
    d = _half(data.reshape(n, ns, 210)[..., 208:210])                                        # [n, ns, 1]
    return ((d * scales)[..., None] * q.reshape(n, ns, 16, 16).float()).reshape(n, k)


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as int8 blocks of 32 (llama.cpp's Q8_0 activations): xq int8 [M, K / 32, 32] and
    dx [M, K / 32, 1]."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv).to(torch.int8), d


def qlinear_q8_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-activation linear in float64: dequantized weights times the dequantized int8 rows of x."""
    xq, d = quantize_act_ref(x)
    xd = (xq.double() * d.double()).reshape(x.shape)
    y = xd @ dequantize_ref(w.data, w.qtype, w.k).double().t()
    return (y if bias is None else y + bias.double()).float()
