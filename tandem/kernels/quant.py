"""Weights kept as GGUF blocks, the quantized linear over them, and the torch reference of both.

A QuantWeight holds the GGUF's own bytes, one row per output feature, regrouped within the row (same size):
each field of the 32-weight blocks gathered into one array, in the block's field order:
    Q4_0 [d fp16 x nb][qs x nb]                    Q4_1 [d fp16 x nb][m fp16 x nb][qs x nb]
    Q8_0 [d fp16 x nb][qs int8[32] x nb]
    Q5_0 [d fp16 x nb][qh u32 x nb][qs x nb]       Q5_1 [d fp16 x nb][m fp16 x nb][qh u32 x nb][qs x nb]
    MXFP4 [e uint8 x nb][qs x nb]                  (gpt-oss's experts: value MXFP4_VALUES[nibble] 2^(e - 128))
qs: 16 bytes of nibbles (Q4, Q5 low bits, MXFP4: element i < 16 the low nibble of byte i, i >= 16 the high nibble
of byte i - 16), qh: bit i the fifth bit of element i. nb = K / 32 blocks. MXFP4's nibble is an E2M1 value doubled
to an integer (-12..12), e an E8M0 exponent: the block's scale 2^(e - 127) / 2, from the bits as ggml's
GGML_E8M0_TO_FP32_HALF (e < 2: the fp32 subnormals 2^-128, 2^-127), so every byte of e is finite (e8m0_half_ref).
Scales apart from quants let a kernel convert 16 scales in one instruction and broadcast them from memory
(measured: the per-block fp16 scale handling of the interleaved GGUF layout kept the AVX-512 decode kernel on one
execution port). K-quants
(256-weight super-blocks): Q2_K, Q3_K and Q6_K rows keep the GGUF's bytes; Q4_K rows are regrouped (same size) as
[16-byte super-block headers][quants, 16 bytes a 32-weight sub-block in Q4_0's nibble order], so the kernels
treat a sub-block as a Q4_1 block (measured: the GGUF's order, two sub-blocks sharing 32 bytes, cost 1.6x
Q4_1's time per weight); Q5_K rows likewise as [headers][qh u32 a sub-block][qs 16 bytes a sub-block], a
sub-block then being a Q5_1 block. Their 6-bit / int8 sub-block scales are decoded once per row and call.
F16 / BF16 rows are the GGUF's halves, read by the same kernels as blocks of 32 (half the bytes of fp32).
Rows are whole blocks along K, so permuting or concatenating rows (llama's q/k un-permutation, the fused qkv
and gate_up) works on the bytes as on a dense matrix. See csrc/linear_rows.cpp for the block formats.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 1, 2, 3, 6, 7, 8, 30                          # ggml type ids
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
MXFP4 = 39
BLOCK_BYTES = {F16: 64, BF16: 64, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q2_K: 84, Q3_K: 110,
               Q4_K: 144, Q5_K: 176, Q6_K: 210, MXFP4: 17}   # per block (F16 / BF16: 32 halves)
# MXFP4's nibble -> twice its E2M1 value (ggml's kvalues_mxfp4), so a block's scale is 2^(e - 127) / 2.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
K_QUANTS = frozenset({Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
BLOCK_WEIGHTS = {q: 256 if q in K_QUANTS else 32 for q in BLOCK_BYTES}  # weights along K per block
# Bytes of each field of a 32-weight block, in the GGUF's order (the regrouped row keeps one array a field).
BLOCK_FIELDS = {Q4_0: (2, 16), Q4_1: (2, 2, 16), Q5_0: (2, 4, 16), Q5_1: (2, 2, 4, 16), Q8_0: (2, 32),
                MXFP4: (1, 16)}
# What tandem.linear_rows_q8act reads (kernels_act="int8", the default): every integer block type. F16 / BF16 weights
# keep fp32 activations (their values are not integers; llama.cpp rounds x to F16 / BF16 for them instead).
INT8_ACT_QTYPES = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4})
NATIVE_QTYPES = frozenset(BLOCK_BYTES)
# Rows of x up to which the in-kernel GEMV bodies run (linear_rows, linear_rows_q8act; measured: 1.4x the fp32 GEMM at
# 65 rows, even at 128); past it MKL's fp32 GEMM on weights dequantized into a reused buffer takes over, or with int8
# activations the int8 GEMM gemm_rows_q8act (gemm_rows() below: right there, with VNNI and AVX2). Each body keeps
# an output's operations the same at every row count on its side (batch invariance), not across: small_m()
# is the one row count where a row's last bits can change (Q4_1 / Q4_K / Q8_0 / Q5_0 / MXFP4 with VNNI: none, see
# GEMM_ROWS). MXFP4 on AVX2 (and the scalar body) meets the GEMM there as Q4_0 does: its decode body sums 4-product
# partials per lane, so gemv_is_gemm() is False; a linear with its packed copy runs that at every row count on AVX2
# (packed_rows), one without takes the GEMM at every row count (QLinear.gemm_always).
SMALL_M = 96
# The AVX2 body has half the registers and lanes: measured with it forced on this machine, it beat the fp32
# GEMM at 8 rows (1.3x) and lost at 64 (0.5x).
SMALL_M_AVX2 = 16


_AS_IS = frozenset({F16, BF16, Q2_K, Q3_K, Q6_K})     # rows that keep the GGUF's bytes


@dataclass(frozen=True)
class QuantWeight:
    data: torch.Tensor          # uint8 [N, K / BLOCK_WEIGHTS * BLOCK_BYTES], rows regrouped (module docstring)
    qtype: int
    k: int                      # input features

    @staticmethod
    def from_gguf(blocks: torch.Tensor, qtype: int, k: int) -> "QuantWeight":
        """From GGUF rows of interleaved blocks, uint8 [N, K / block weights * block bytes]."""
        if qtype in _AS_IS:
            return QuantWeight(blocks.contiguous(), qtype, k)
        if qtype == Q4_K:
            return QuantWeight(_q4_k_regroup(blocks, k), qtype, k)
        if qtype == Q5_K:
            return QuantWeight(_q5_k_regroup(blocks, k), qtype, k)
        n, nb = blocks.shape[0], k // 32
        fields = torch.split(blocks.reshape(n, nb, BLOCK_BYTES[qtype]), BLOCK_FIELDS[qtype], dim=2)
        return QuantWeight(torch.cat([f.reshape(n, -1) for f in fields], dim=1).contiguous(), qtype, k)

    def to_gguf(self) -> torch.Tensor:
        """The GGUF rows back (interleaved blocks)."""
        if self.qtype in _AS_IS:
            return self.data
        if self.qtype == Q4_K:
            return _q4_k_ungroup(self.data, self.k)
        if self.qtype == Q5_K:
            return _q5_k_ungroup(self.data, self.k)
        n, nb = self.data.shape[0], self.k // 32
        sizes = BLOCK_FIELDS[self.qtype]
        fields = torch.split(self.data, [nb * f for f in sizes], dim=1)
        return torch.cat([f.reshape(n, nb, b) for f, b in zip(fields, sizes)], dim=2).reshape(n, -1).contiguous()

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
        from .library import available
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
    """Rows up to which linear_rows runs in-kernel on this CPU."""
    global _small_m
    if _small_m is None:
        _small_m = SMALL_M if torch.ops.tandem.isa(-1) == 2 else SMALL_M_AVX2
    return _small_m


def linear_rows(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, int8_act: bool = False
            ) -> torch.Tensor:
    """x [M, K] fp32 @ dequant(w)^T (+ bias) -> [M, N]. int8_act (INT8_ACT_QTYPES): rows of x rounded to int8
    halves of 16 first; past gemm_rows() rows by the int8 GEMM gemm_rows_q8act, else up to small_m() rows by
    linear_rows_q8act. Otherwise (fp32 activations, or a type without the int8 GEMM) past small_m() rows the weights are
    dequantized into a reused buffer for MKL's fp32 GEMM."""
    global _scratch
    q8 = int8_act and w.qtype in INT8_ACT_QTYPES
    m = x.shape[0]
    if q8 and m > gemm_rows(w.qtype):
        return torch.ops.tandem.gemm_rows_q8act(x, w.data, w.qtype, w.k, bias)
    if m <= small_m():
        if q8:
            return torch.ops.tandem.linear_rows_q8act(x, w.data, w.qtype, w.k, bias)
        return torch.ops.tandem.linear_rows(x, w.data, w.qtype, w.k, bias)
    if _scratch.numel() < w.numel():
        _scratch = torch.empty(w.numel())
    dense = _scratch[:w.numel()].view(w.shape)
    torch.ops.tandem.dequantize_out(w.data, w.qtype, w.k, dense)
    return F.linear(x, dense, bias)


# Rows of x past which gemm_rows_q8act takes over from linear_rows_q8act's GEMV bodies, by the GEMM's body on this CPU
# (gemm_rows_q8act_body). Not where the GEMM gets faster (one thread, Intel Xeon with AMX, SmolLM2 / Gemma 3 shapes,
# Q4_1 / Q4_K / Q6_K / Q8_0 / Q5_0: the AMX body level with linear_rows_q8act at 16-24 rows and 2.2x ahead at 64, the
# VNNI body level at 24-32 and 1.7x at 64) but small_m(): the two round x the same way and differ in fp32
# order only, yet in the int8 mode a last-bit difference moves a value of the next layer across a rounding
# step of x now and then, and 30 layers grow that to ~0.01-0.07 in a logprob (measured on SmolLM2: one prompt
# prefilled in chunks of 16 rows, the GEMV, vs 24, the GEMM with its threshold lowered to 20). So the boundary
# stays at the decode batch sizes' far end; only one arithmetic for every row count removes it, as gemv_rows_q8act
# does for Q4_1 / Q4_K / Q8_0 / Q5_0 (linear_rows_q8act runs it, then the GEMM, at any row count: there the threshold is
# a speed choice only). The AVX2 body (a half's sums in int16 for the narrow types, a last tile's padding half skipped)
# measured on an AMD EPYC Zen 3, one thread: 1.1-3x MKL's fp32 GEMM plus the dequantization at 17-128 rows on
# SmolLM2's and Gemma 3's shapes (the Q8_0 head 2-3x), behind only on the 576 x 1536 down projection at 17-32
# (0.7-0.8x) and the 960 x 576 qkv at 17 (0.7x; level at 24-64), ahead summed over a SmolLM2 layer and head at
# every row count, so it too takes over at small_m() and no fp32 GEMM runs between the two.
GEMM_ROWS = {3: SMALL_M, 2: SMALL_M, 1: SMALL_M_AVX2}
_packed_rows: dict[int, int] = {}


def packed_rows(qtype: int) -> int:
    """Rows of x up to which a linear with a repacked copy of its weight (tandem.pack_gemv, made at load for
    Q4_0 / Q4_1 / Q5_0 / Q8_0 / MXFP4 and Q2_K to Q6_K with int8 activations; the K-quants take every row count
    where a body runs) runs tandem.gemv_packed_q8act, the GEMM's bits at 2-2.7x the row layout's GEMV
    (csrc/gemv_packed_q8act.cpp says where it was measured): 256 with AVX-512 VNNI and AMX (past it the GEMM's AMX
    tiles); 4096 with VNNI and no AMX (1.08-1.86x the GEMM's VNNI body up to 2048 rows, prefill
    chunks too); with AVX2 every row count (2^40: its many-row tile is level with or ahead of the AVX2 GEMM up to
    2048 rows).
    0: no copy is made for this type here."""
    if qtype not in _packed_rows:
        from .library import available
        _packed_rows[qtype] = torch.ops.tandem.gemv_packed_q8act_max_rows(qtype) if available() else 0
    return _packed_rows[qtype]


def packed_gather(packed: torch.Tensor, qtype: int, k: int, n: int, index: torch.Tensor) -> torch.Tensor:
    """fp32 rows [len(index), k] of an n-row weight read out of its packed copy (tandem.pack_gemv), bit for bit
    QuantWeight.rows on the row layout: a tied embedding looks its tokens up in the LM head's packed copy, so a
    head that dropped its row layout (QLinear.release_rows) holds the matrix once."""
    return torch.ops.tandem.packed_gather(packed, qtype, k, n, index)


_gemm_rows: dict[int, int] = {}


def gemm_rows(qtype: int) -> int:
    """Rows of x past which linear_rows runs the int8 GEMM for this type on this CPU (a huge number: never)."""
    if qtype not in _gemm_rows:
        # Never below small_m() (an AVX-512 CPU without VNNI runs the AVX2 GEMM body: there it is small_m())
        _gemm_rows[qtype] = max(GEMM_ROWS.get(torch.ops.tandem.gemm_rows_q8act_body(qtype), 1 << 62), small_m())
    return _gemm_rows[qtype]


_gemv_is_gemm: dict[int, bool] = {}


def gemv_is_gemm(w: QuantWeight) -> bool:
    """Does linear_rows_q8act's GEMV give a row the int8 GEMM's bits for w's type on this CPU (and ISA body)? Probed
    once a type on w's first rows: where it does not (Q5_1 here), a linear that would switch from one to the other at
    gemm_rows() takes the GEMM at every row count instead (QLinear.gemm_always), so a row's bits never follow
    the step's size (batch invariance, model/attention_paths.py). True where no GEMM body runs this type."""
    if w.qtype not in _gemv_is_gemm:
        if gemm_rows(w.qtype) >= 1 << 62:
            _gemv_is_gemm[w.qtype] = True
        else:
            rows = w.data[:32].contiguous()
            x = torch.randn(3, w.k, generator=torch.Generator().manual_seed(0))
            _gemv_is_gemm[w.qtype] = torch.equal(torch.ops.tandem.linear_rows_q8act(x, rows, w.qtype, w.k, None),
                                                 torch.ops.tandem.gemm_rows_q8act(x, rows, w.qtype, w.k, None))
    return _gemv_is_gemm[w.qtype]


# ---------------------------------------------------------------------------------------- torch reference
def dequantize_ref(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """fp32 [N, K] from QuantWeight rows, in torch ops (the specification the native op is tested against)."""
    if qtype in K_QUANTS:
        ungroup = {Q4_K: _q4_k_ungroup, Q5_K: _q5_k_ungroup}.get(qtype)
        return _dequantize_k_ref(ungroup(data, k) if ungroup else data, qtype, k)
    n, nb = data.shape[0], k // 32
    if qtype == F16:
        return data.contiguous().view(torch.float16).float()
    if qtype == BF16:
        return (data.contiguous().view(torch.int16).int() << 16).view(torch.float32)
    if qtype == MXFP4:
        return _dequantize_mxfp4_ref(data, k)
    if qtype in (Q5_0, Q5_1):
        d, *m, qh, qs = torch.split(data, [nb * f for f in BLOCK_FIELDS[qtype]], dim=1)
        d = _half(d.reshape(n, nb, 2))                                                # [N, nb, 1]
        q = torch.cat([qs.reshape(n, nb, 16) & 15, qs.reshape(n, nb, 16) >> 4], dim=-1).int()
        q = q | (_bits32(qh.reshape(n, nb, 4)) << 4)                                  # [N, nb, 32] 0..31
        if qtype == Q5_0:
            return (d * (q - 16).float()).reshape(n, k)
        return (d * q.float() + _half(m[0].reshape(n, nb, 2))).reshape(n, k)
    d = data[:, :2 * nb].contiguous().view(torch.float16).float()[..., None]     # [N, nb, 1]
    if qtype == Q8_0:
        return (d * data[:, 2 * nb:].contiguous().view(torch.int8).float().view(n, nb, 32)).reshape(n, k)
    qs = data[:, (4 if qtype == Q4_1 else 2) * nb:].reshape(n, nb, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()                 # element i<16: low nibble of byte i
    if qtype == Q4_0:
        return (d * (q - 8)).reshape(n, k)
    m = data[:, 2 * nb:4 * nb].contiguous().view(torch.float16).float()[..., None]
    return (d * q + m).reshape(n, k)


def e8m0_half_ref(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^(e - 128) of E8M0 bytes, from the bits (ggml's GGML_E8M0_TO_FP32_HALF): (e - 1) << 23, and for e < 2
    the subnormals 0x00200000 << e."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _dequantize_mxfp4_ref(data: torch.Tensor, k: int) -> torch.Tensor:
    """MXFP4 rows [e x nb][qs x nb] -> fp32 [N, K]: value times the scale, one rounding (exact: a power of two
    times an integer of at most 4 bits, subnormals included)."""
    n, nb = data.shape[0], k // 32
    d = e8m0_half_ref(data[:, :nb])[..., None]                                          # [N, nb, 1]
    qs = data[:, nb:].reshape(n, nb, 16).long()
    q = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[torch.cat([qs & 15, qs >> 4], dim=-1)]
    return (q * d).reshape(n, k)


def linear_rows_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
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


def _bits32(b: torch.Tensor) -> torch.Tensor:
    """int32 [..., 32] of the bits of little-endian 32-bit masks [..., 4] (bit i of byte j at 8 j + i)."""
    return ((b.int()[..., :, None] >> torch.arange(8, dtype=torch.int32)) & 1).flatten(-2)


def _pack_bits32(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of _bits32: uint8 [..., 4] from bits [..., 32]."""
    w = (bits.reshape(*bits.shape[:-1], 4, 8).int() << torch.arange(8, dtype=torch.int32)).sum(-1)
    return w.to(torch.uint8)


def _q5_k_regroup(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q5_K rows -> [headers (d, dmin, scales: 16 bytes) x ns][qh u32 x nb: bit i the fifth bit of weight i
    of the sub-block][qs: 16 bytes a sub-block, Q4_0's nibble order]. GGUF: qh[32], bit j of byte l the fifth bit
    of weight l of sub-block j; qs[128] as Q4_K's."""
    n, ns = blocks.shape[0], k // 256
    b = blocks.reshape(n, ns, 176)
    bits = (b[..., 16:48].int()[:, :, None, :] >> torch.arange(8, dtype=torch.int32)[:, None]) & 1   # [n, ns, 8, 32]
    qh = _pack_bits32(bits)                                                         # [n, ns, 8, 4]
    lo = _q4_k_regroup(torch.cat([b[..., :16], b[..., 48:]], dim=-1).reshape(n, -1), k)
    return torch.cat([lo[:, :16 * ns], qh.reshape(n, -1), lo[:, 16 * ns:]], dim=1).contiguous()


def _q5_k_ungroup(data: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of _q5_k_regroup: GGUF Q5_K rows."""
    n, ns = data.shape[0], k // 256
    head, qh, qs = torch.split(data, [16 * ns, 32 * ns, 128 * ns], dim=1)
    bits = _bits32(qh.reshape(n, ns, 8, 4))                                          # [n, ns, 8 (j), 32 (l)]
    qh = (bits << torch.arange(8, dtype=torch.int32)[:, None]).sum(2).to(torch.uint8)   # [n, ns, 32]
    lo = _q4_k_ungroup(torch.cat([head, qs], dim=1), k).reshape(n, ns, 144)
    return torch.cat([lo[..., :16], qh, lo[..., 16:]], dim=-1).reshape(n, -1).contiguous()


def _half(b: torch.Tensor) -> torch.Tensor:
    """fp32 of little-endian fp16 bytes [..., 2]."""
    return b.contiguous().view(torch.float16).float()


def _dequantize_k_ref(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """K-quant super-blocks (GGUF layout, csrc/linear_rows.cpp) -> fp32 [N, K]."""
    n, ns = data.shape[0], k // 256
    raw = data.reshape(n, ns, BLOCK_BYTES[qtype])
    b = raw.int()
    two = torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)
    if qtype in (Q2_K, Q3_K):                                   # element 128 h + 32 t + l: qs[32 h + l] >> 2 t & 3
        off = 16 if qtype == Q2_K else 32
        q = ((b[..., off:off + 64].reshape(n, ns, 2, 1, 32) >> two) & 3).reshape(n, ns, 16, 16)
        if qtype == Q2_K:
            d, dmin, s = _half(raw[..., 80:82]), _half(raw[..., 82:84]), b[..., :16]
            dl, ml = (d * (s & 15).float())[..., None], (dmin * (s >> 4).float())[..., None]
            return (dl * q.float() - ml).reshape(n, k)
        h = (b[..., None, :32] >> torch.arange(8).view(8, 1)) & 1                  # [n, ns, 8 (4 h + t), 32]
        q = q - ((1 - h) << 2).reshape(n, ns, 16, 16)
        s = b[..., 96:108]
        lo = (s[..., None, :8] >> torch.tensor([0, 4]).view(2, 1)) & 15             # [n, ns, 2, 8]
        hi = (s[..., None, 8:12] >> two.view(4, 1)) & 3                             # [n, ns, 4, 4]
        scale = (lo.reshape(n, ns, 16) | (hi.reshape(n, ns, 16) << 4)) - 32
        dl = (_half(raw[..., 108:110]) * scale.float())[..., None]
        return (dl * q.float()).reshape(n, k)
    if qtype in (Q4_K, Q5_K):
        d, dmin, s = _half(raw[..., 0:2]), _half(raw[..., 2:4]), b[..., 4:16]
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)      # [n, ns, 8]
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
        qs = b[..., -128:].reshape(n, ns, 4, 1, 32)
        q = ((qs >> torch.tensor([0, 4]).view(1, 1, 1, 2, 1)) & 15).reshape(n, ns, 8, 32)
        if qtype == Q5_K:                                       # bit j of qh[l]: the fifth bit of weight l of j
            q = q | (((b[..., 16:48, None] >> torch.arange(8)) & 1).transpose(-1, -2) << 4)
        return ((d * sc.float())[..., None] * q.float() - (dmin * mn.float())[..., None]).reshape(n, k)
    ql, qh = b[..., :128].reshape(n, ns, 2, 1, 64), b[..., 128:192].reshape(n, ns, 2, 1, 32)
    lo = (ql >> torch.tensor([0, 4]).view(1, 1, 1, 2, 1)) & 15                      # [n, ns, 2, 2, 64]
    hi = (qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)) & 3                  # [n, ns, 2, 4, 32]
    q = (lo.reshape(n, ns, 2, 4, 32) | (hi << 4)) - 32                               # element 128h + 32t + l
    scales = data.reshape(n, ns, 210)[..., 192:208].contiguous().view(torch.int8).float()   # [n, ns, 16]
    d = _half(data.reshape(n, ns, 210)[..., 208:210])                                        # [n, ns, 1]
    return ((d * scales)[..., None] * q.reshape(n, ns, 16, 16).float()).reshape(n, k)


K8_QTYPES = (Q4_K, Q5_K, Q6_K)   # the K8 contract (csrc/k8_spec.cpp): x rounded per 256-weight super-block


def act_block(qtype: int | None) -> int:
    """Elements of x sharing one int8 scale in front of a weight of this type: a super-block of 256 for Q4_K /
    Q5_K / Q6_K (llama.cpp's Q8_K: their integer sums span the super-block), else a half of 16."""
    return 256 if qtype in K8_QTYPES else 16


def quantize_act_ref(x: torch.Tensor, qtype: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as int8 blocks of act_block(qtype) (kernels_act="int8"; llama.cpp's Q8_0 activations use
    blocks of 32): xq int8 [M, K / B, B] and dx [M, K / B, 1], dx = max |x| / 127 of the block."""
    xb = x.reshape(x.shape[0], -1, act_block(qtype))
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv).to(torch.int8), d


def linear_rows_q8act_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-activation linear in float64: dequantized weights times the dequantized int8 rows of x."""
    xq, d = quantize_act_ref(x, w.qtype)
    xd = (xq.double() * d.double()).reshape(x.shape)
    y = xd @ dequantize_ref(w.data, w.qtype, w.k).double().t()
    return (y if bias is None else y + bias.double()).float()
