"""The int8 GEMV on weights repacked at load (tandem.pack_gemv / tandem.gemv_packed_q8act; Q4_0, Q4_1, Q5_0, Q8_0, MXFP4
and the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; AVX-512 VNNI and AVX2 bodies): its rows equal gemm_rows_q8act's bit for
bit at any row count, so a model that runs it for its decode and verify steps gives the same tokens and logprobs as one
that does not. Bad inputs are refused with a clear error."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.isa import runnable
from tests.kernels.test_gemm_rows_q8act import _weight
from tests.kernels.test_quant_types import whole

from tandem import kernels
from tandem.kernels.quant import (MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, dequantize_ref,
                                  packed_rows, linear_rows_q8act_ref, small_m)

pytestmark = pytest.mark.skipif(not kernels.available() or torch.ops.tandem.gemv_packed_q8act_max_rows(Q4_1) == 0,
                                reason="needs the native kernels on a CPU with AVX2")
BODIES = runnable((1, 2), vnni=True)                             # AVX2, and AVX-512 VNNI where it is here
TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q8_0": Q8_0, "Q2_K": Q2_K, "Q3_K": Q3_K, "Q4_K": Q4_K, "Q5_K": Q5_K,
         "Q6_K": Q6_K, "MXFP4": MXFP4}
T = torch.ops.tandem


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m, n, k", [(1, 13, 224), (3, 25, 576), (5, 40, 608), (16, 33, 1536), (7, 16, 32),
                                     (2, 17, 96), (9, 3, 160), (1, 100, 64), (2, 70, 64), (4, 65, 128),
                                     (1, 64, 576), (6, 1, 32), (203, 45, 96), (64, 24, 1536)])
def test_packed_gemv_equals_the_gemm_bit_for_bit(name, m, n, k):
    """Any rows of x (Q4_0 / Q4_1 / Q5_0 / Q8_0: one-row tiles of 4 groups, two-row tiles of 2, 4-row tiles; K-quants:
    a group a tile, 8- and 4-row tiles and narrower last ones; AVX2's many-row tiles of 5 / 6 rows and their
    narrower last ones, a group's second 8 rows full, partial or past N), N off the 16-row groups and the
    4-group tiles, zero halves, large and small values, with and without bias."""
    qtype = TYPES[name]
    k = whole(k, qtype)
    q = _weight(n, k, qtype, seed=m + n)
    x, bias = torch.randn(m, k) * 3, torch.randn(n)
    x[0, : k // 2] = 0
    if m > 1:
        x[1] *= 1e-3
    packed = T.pack_gemv(q.data, qtype, k)
    for b in (None, bias):
        gemm = T.gemm_rows_q8act(x, q.data, qtype, k, b)
        for isa in BODIES:
            assert torch.equal(T.gemv_packed_q8act(x, packed, qtype, k, n, b, isa), gemm), isa


@pytest.mark.parametrize("name", TYPES)
def test_a_row_has_the_same_bits_at_every_row_count_and_thread_count(name):
    qtype = TYPES[name]
    k = whole(608, qtype)
    q = _weight(37, k, qtype, seed=3)
    packed = T.pack_gemv(q.data, qtype, k)
    x, bias = torch.randn(40, k), torch.randn(37)
    full = T.gemm_rows_q8act(x, q.data, qtype, k, bias)
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40):
        for isa in BODIES:
            assert torch.equal(T.gemv_packed_q8act(x[:m], packed, qtype, k, 37, bias, isa), full[:m]), (m, isa)
        # linear_rows_q8act runs the GEMM's arithmetic where gemv_rows_q8act_max_rows says so (AVX-512 VNNI: Q4_1,
        # Q8_0); elsewhere (Q4_0; Q4_1 and Q8_0 on AVX2) its own body, another fp32 order: the packed copy unifies them.
        if T.gemv_rows_q8act_max_rows(qtype) > 0:
            assert torch.equal(T.linear_rows_q8act(x[:m], q.data, qtype, k, bias), full[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(T.gemv_packed_q8act(x[39:], packed, qtype, k, 37, bias), full[39:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_the_thread_split_gives_every_output_once_with_the_same_bits(name):
    """The GEMVs' threads take pieces from one another (csrc/steal.h): at 2, 3 and 8 threads (past the cores:
    threads are descheduled mid-region and others take their pieces), one and two rows, every output is written
    once (y starts unwritten) with the bits of one thread and of gemm_rows_q8act."""
    qtype = TYPES[name]
    k, n = whole(256, qtype), 16 * 4 * 37 + 5         # 149 chunks of 4 groups, the last one partial
    q = _weight(n, k, qtype, seed=11)
    packed = T.pack_gemv(q.data, qtype, k)
    x = torch.randn(2, k)
    gemm = T.gemm_rows_q8act(x, q.data, qtype, k, None)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3, 8):
            torch.set_num_threads(t)
            for m in (1, 2):
                for _ in range(3):
                    assert torch.equal(T.gemv_packed_q8act(x[:m], packed, qtype, k, n, None), gemm[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)


def test_linear_rows_runs_the_packed_copy_with_the_same_bits():
    """QLinear makes the copy for int8 activations only, runs it up to packed_rows() rows and the row layout's
    ops past them: every row count gives the GEMM's bits, as without the copy where the row layout's GEMV runs
    the GEMM's arithmetic (gemv_rows_q8act_max_rows; not the AVX2 body of Q4_1)."""
    from tandem.model.linear import QLinear
    q = _weight(50, 576, Q4_1, seed=5)
    lin, exact = QLinear(q, int8_act=True), QLinear(q, int8_act=False)
    assert lin.packed is not None and lin.packed_rows == packed_rows(Q4_1) >= 16 and exact.packed is None
    assert QLinear(_weight(20, 256, Q5_1, seed=0), int8_act=True).packed is None      # not a packed type
    plain = QLinear(q, int8_act=True)
    plain.packed_rows = 0
    x = torch.randn(40, 576)
    for m in (1, 5, 16, 17, 40):
        assert torch.equal(lin(x[:m]), T.gemm_rows_q8act(x[:m], q.data, Q4_1, 576, None)), m
        if T.gemv_rows_q8act_max_rows(Q4_1) > 0 or m > small_m():
            assert torch.equal(lin(x[:m]), plain(x[:m])), m


def test_k_quants_packed_copy_is_the_files_size_and_close_to_the_specification():
    """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K: the packed layout is 16 rows x the GGUF's bytes (no larger than the file),
    and the output is within fp32 rounding of the float64 specification (linear_rows_q8act_ref)."""
    for qtype, nbytes in ((Q2_K, 84), (Q3_K, 110), (Q4_K, 144), (Q5_K, 176), (Q6_K, 210)):
        q = _weight(48, 512, qtype, seed=7)
        packed = T.pack_gemv(q.data, qtype, 512)
        assert packed.shape == (3, 16 * 2 * nbytes) and packed.numel() == q.data.numel()
        x = torch.randn(3, 512)
        for isa in BODIES:
            y = T.gemv_packed_q8act(x, packed, qtype, 512, 48, None, isa)
            torch.testing.assert_close(y, linear_rows_q8act_ref(x, q), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype, nbytes, d_at", [(Q5_K, 176, 0), (Q4_K, 144, 0), (Q6_K, 210, 208), (Q3_K, 110, 108),
                                                  (Q2_K, 84, 80)])
def test_k_quant_extreme_sums_do_not_overflow(qtype, nbytes, d_at):
    """Every quant at its top value (Q5_K 31, Q4_K 15, Q6_K's unsigned 63, Q3_K's unsigned 7, Q2_K 3) and every
    scale and min at its largest (Q6_K's scales -128) against x rounded to +-127 everywhere: AVX2's int16 sum of a
    half's 4 pmaddubsw is at its largest (Q5_K's 4 x 2 x 31 x 127), the K8 contract's super-block integer too
    (Q6_K: 16 x 128 x 16 x 63 x 127 before its offset), and still the GEMM's bits."""
    from tandem.kernels.quant import QuantWeight
    b = torch.full((20, 2, nbytes), 0xFF, dtype=torch.uint8)
    d = torch.tensor([0.01, 0.002], dtype=torch.float16).view(torch.uint8)            # d, dmin
    one_d = qtype in (Q3_K, Q6_K)
    b[..., d_at:d_at + (2 if one_d else 4)] = d[:2] if one_d else d                     # Q3_K, Q6_K: d alone
    if qtype == Q6_K:
        b[..., 192:208] = 0x80
    q = QuantWeight.from_gguf(b.reshape(20, -1), qtype, 512)
    packed = T.pack_gemv(q.data, qtype, 512)
    x = torch.ones(3, 512)
    x[1] = -1
    x[2, 256:] = -1
    gemm = T.gemm_rows_q8act(x, q.data, qtype, 512, None)
    scale = float((x.abs() @ dequantize_ref(q.data, qtype, 512).abs().t()).max())     # row 2's halves cancel
    torch.testing.assert_close(gemm, linear_rows_q8act_ref(x, q), rtol=1e-5, atol=1e-7 * scale)
    for isa in BODIES:
        assert torch.equal(T.gemv_packed_q8act(x, packed, qtype, 512, 20, None, isa), gemm), isa


def test_k_quant_linear_rows_keeps_each_weight_once():
    """A K-quant QLinear (several parts of mixed types too, as the qkv of Q4_K_M, Q5_K_M, Q3_K_M and Q2_K files) runs
    its packed copies at every row count with the GEMM's bits, and release_rows() drops the row layout: what it
    holds is the file's bytes."""
    from tandem.model.linear import QLinear
    parts = [_weight(32, 512, Q4_K, seed=1), _weight(16, 512, Q6_K, seed=2), _weight(32, 512, Q5_K, seed=3),
             _weight(48, 512, Q3_K, seed=4), _weight(16, 512, Q2_K, seed=5)]
    bias = torch.randn(144)
    lin = QLinear(parts, bias, int8_act=True)
    x = torch.randn(150, 512)
    want = torch.cat([T.gemm_rows_q8act(x, p.data, p.qtype, 512, None) for p in parts], dim=1) + bias
    lin.release_rows()
    assert not lin.holds_rows and sum(p.data.numel() for p in lin.parts) == 0
    assert sum(pk.numel() for pk in lin.packed_parts) == sum(p.data.numel() for p in parts)
    for m in (1, 3, 37, 150):
        assert torch.equal(lin(x[:m]), want[:m]), m
    kept = QLinear(parts[0], int8_act=False)           # the exact mode keeps its rows: no packed copy
    kept.release_rows()
    assert kept.holds_rows and kept.packed is None


def test_refusals():
    q = _weight(20, 256, Q5_1, seed=0)
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K"):
        T.pack_gemv(q.data, Q5_1, 256)
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K"):
        T.gemv_packed_q8act(torch.randn(1, 256), q.data, Q5_1, 256, 20)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        T.pack_gemv(_weight(20, 256, Q4_K, seed=0).data, Q4_K, 320)
    with pytest.raises(RuntimeError, match=r"contiguous uint8 \[N, 84\]"):            # another type's rows
        T.pack_gemv(_weight(20, 256, Q3_K, seed=0).data, Q2_K, 256)
    q = _weight(20, 64, Q8_0, seed=0)
    packed = T.pack_gemv(q.data, Q8_0, 64)
    assert packed.shape == (2, 2 * (512 + 32))
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        T.pack_gemv(q.data[:, :10].contiguous(), Q8_0, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        T.pack_gemv(q.data, Q8_0, 48)
    with pytest.raises(RuntimeError, match="for N = 40"):
        T.gemv_packed_q8act(torch.randn(1, 64), packed, Q8_0, 64, 40)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        T.gemv_packed_q8act(torch.randn(1, 32), packed, Q8_0, 64, 20)
    with pytest.raises(RuntimeError, match="needs AVX2"):                    # isa 0: the scalar cap
        T.gemv_packed_q8act(torch.randn(1, 64), packed, Q8_0, 64, 20, None, 0)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        T.gemv_packed_q8act(torch.randn(1, 64), packed, Q8_0, 64, 20, torch.randn(3))
    assert T.gemv_packed_q8act(torch.randn(0, 64), packed, Q8_0, 64, 20).shape == (0, 20)
