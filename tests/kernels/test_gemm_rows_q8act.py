"""The int8 GEMM for many rows (tandem.gemm_rows_q8act, kernels_act="int8" past small_m() rows): every integer block
type against the float64 product of the same rounded activations and dequantized weights, each SIMD body equal
to the scalar specification bit for bit, a row's output the same at any row count, tile position and thread
count, and bad inputs refused with a clear error."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.isa import runnable
from tests.kernels.test_int8_act import TYPES
from tests.kernels.test_kernels import assert_close_sum, blocks
from tests.kernels.test_quant_types import weights, whole

from tandem import kernels
from tandem.kernels.quant import (F16, GEMM_ROWS, Q4_K, Q6_K, Q8_0, dequantize_ref, gemm_rows, linear_rows,
                                  linear_rows_q8act_ref, quantize_act_ref, small_m)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: "
                                f"{kernels.unavailable_reason()}")


def gemm_bodies() -> list[int]:
    """The forced bodies past the scalar one this CPU runs: 1 AVX2, 2 AVX-512 VNNI, 3 AMX (gemm_rows_q8act's own)."""
    amx = [3] if kernels.available() and torch.ops.tandem.gemm_rows_q8act_body(Q8_0, 3) == 3 else []
    return runnable((1, 2), vnni=True) + amx


def _weight(n: int, k: int, qtype: int, seed: int):
    return blocks(n, k, qtype, seed=seed) if qtype in (Q4_K, Q6_K) else weights(n, k, qtype, seed=seed)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m, n, k", [(17, 13, 224), (64, 25, 576), (200, 12, 512), (1000, 5, 256)])
def test_gemm_rows_q8act_equals_reference(name, m, n, k):
    """The same rounding of x as linear_rows_q8act (quantize_act_ref), exact integer sums, fp32 scaling: within fp32
    summation order of the float64 reference; N off the 12-row tiles and M off the 16-token tiles (padding)."""
    qtype = TYPES[name]
    k = whole(k, qtype)
    q = _weight(n, k, qtype, seed=m + n)
    x, bias = torch.randn(m, k) * 3, torch.randn(n)
    x[0, : k // 2] = 0                                                   # zero halves: dx = 0
    xq, d = quantize_act_ref(x, qtype)
    xd, w = (xq.float() * d).reshape(m, k), dequantize_ref(q.data, q.qtype, k)
    for b in (None, bias):
        y = torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, b)
        assert y.shape == (m, n)
        assert_close_sum(y, xd, w, linear_rows_q8act_ref(x, q, b))
        spec = torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, b, 0)     # the scalar body: the specification
        for isa in gemm_bodies():                                        # AVX2, AVX-512, AMX: equal to it bit for bit
            assert torch.equal(torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, b, isa), spec)


@pytest.mark.parametrize("name", TYPES)
def test_a_row_is_the_same_at_any_row_count(name):
    """Row r of a 300-row call (two passes of 256 tokens, 19 tiles of 16) equals row r alone, in a 3-row call
    and under one thread: an output's operations never depend on M, the tile or the pass it lands in."""
    qtype = TYPES[name]
    k = whole(608, qtype)
    q = _weight(29, k, qtype, seed=5)
    x, bias = torch.randn(300, k), torch.randn(29)
    full = torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, bias)
    for r in (0, 15, 16, 255, 256, 299):
        assert torch.equal(torch.ops.tandem.gemm_rows_q8act(x[r:r + 1], q.data, qtype, k, bias), full[r:r + 1])
    assert torch.equal(torch.ops.tandem.gemm_rows_q8act(x[254:257], q.data, qtype, k, bias), full[254:257])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, bias), full)
    finally:
        torch.set_num_threads(threads)


def test_linear_rows_takes_the_gemm_past_gemm_rows():
    """The Python entry point: gemm_rows_q8act past gemm_rows() rows (GEMM_ROWS by the body: AMX, VNNI, AVX2),
    linear_rows_q8act up to it, the fp32 GEMM on dequantized weights for fp32 activations; small_m() is where the int8
    mode's arithmetic changes (gemm_rows() is never below it, and with a SIMD body no fp32 GEMM runs between them)."""
    q = _weight(40, 512, Q6_K, seed=1)
    body = torch.ops.tandem.gemm_rows_q8act_body(Q6_K)
    assert gemm_rows(Q6_K) == max(GEMM_ROWS.get(body, 1 << 62), small_m()) and (body == 0 or gemm_rows(Q6_K) < 200)
    assert body == 0 or gemm_rows(Q6_K) == small_m()
    assert torch.ops.tandem.gemm_rows_q8act_body(F16) == 0 and gemm_rows(F16) == 1 << 62
    assert gemm_rows(Q8_0) >= small_m() and gemm_rows(Q6_K) >= small_m()
    x = torch.randn(min(gemm_rows(Q6_K), 1000) + 7, 512)
    y = linear_rows(x, q, int8_act=True)
    dense = torch.nn.functional.linear(x, dequantize_ref(q.data, Q6_K, 512))
    assert torch.equal(y, torch.ops.tandem.gemm_rows_q8act(x, q.data, Q6_K, 512) if body else dense)
    big = torch.randn(small_m() + 7, 512)                               # fp32 activations: the GEMM past small_m()
    assert torch.equal(linear_rows(big, q), torch.nn.functional.linear(big, dequantize_ref(q.data, Q6_K, 512)))
    few = x[: small_m()]
    assert torch.equal(linear_rows(few, q, int8_act=True), torch.ops.tandem.linear_rows_q8act(few, q.data, Q6_K, 512))


def test_gemm_rows_q8act_refuses_bad_inputs():
    q = _weight(4, 256, Q8_0, seed=0)
    x = torch.randn(20, 256)
    with pytest.raises(RuntimeError, match="int8 activations support Q4_0"):
        torch.ops.tandem.gemm_rows_q8act(x, weights(4, 256, F16).data, F16, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.tandem.gemm_rows_q8act(torch.randn(20, 96), blocks(2, 256, Q6_K).data, Q6_K, 96)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.tandem.gemm_rows_q8act(torch.randn(20, 128), q.data, Q8_0, 256)
    with pytest.raises(RuntimeError, match="w must be a contiguous uint8"):
        torch.ops.tandem.gemm_rows_q8act(x, q.data[:, :-2], Q8_0, 256)
    for op in (torch.ops.tandem.gemm_rows_q8act, torch.ops.tandem.linear_rows_q8act):     # one check serves both ops
        with pytest.raises(RuntimeError, match="bias must be fp32"):
            op(x, q.data, Q8_0, 256, torch.randn(5))
    assert torch.ops.tandem.gemm_rows_q8act(x[:0], q.data, Q8_0, 256).shape == (0, 4)


def test_simd_rounding_of_x_equals_the_scalar_loop(tmp_path):
    """quantize_row's AVX-512 and AVX2 halves give the scalar loop's bytes and sums: the scalar dot bodies of
    linear_rows_q8act and gemm_rows_q8act (isa=0) in processes capped at TANDEM_ISA=scalar / avx2 (so rounding x with
    that ISA) equal them here bit for bit. x holds ties (k + 0.5 at dx = 1: nearest even), zeros and large values."""
    import os
    import subprocess
    import sys
    q = _weight(7, 512, Q8_0, seed=2)
    x = torch.randn(20, 512) * 5
    x[0, :16] = torch.tensor([127.0] + [k + 0.5 for k in range(-7, 8)])
    x[1, 16:48] = 0
    x[2] *= 1e4
    torch.save({"x": x, "w": q.data}, tmp_path / "in.pt")
    code = ("import sys, torch; from tandem import kernels; kernels.available(); d = torch.load(sys.argv[1]); "
            "torch.save([torch.ops.tandem.linear_rows_q8act(d['x'], d['w'], 8, 512, None, 0), "
            "torch.ops.tandem.gemm_rows_q8act(d['x'], d['w'], 8, 512, None, 0)], sys.argv[2])")
    here = [torch.ops.tandem.linear_rows_q8act(x, q.data, Q8_0, 512, None, 0),
            torch.ops.tandem.gemm_rows_q8act(x, q.data, Q8_0, 512, None, 0)]
    for cap in ("scalar", "avx2"):
        out = tmp_path / f"{cap}.pt"
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(out)], check=True,
                       env=dict(os.environ, TANDEM_ISA=cap))
        for a, b in zip(torch.load(out), here):
            assert torch.equal(a, b), cap


def test_tandem_isa_caps_the_amx_body():
    """TANDEM_ISA=avx512 (or lower) turns the AMX body off, as it caps every other op; unset or "amx" keeps it."""
    import os
    import subprocess
    import sys
    if 3 not in gemm_bodies():
        pytest.skip("this CPU has no AMX-INT8")
    code = "from tandem import kernels; kernels.available(); import torch; print(torch.ops.tandem.gemm_rows_q8act_body(8))"
    for cap, body in (("avx512", "2"), ("amx", "3"), ("", "3")):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             env=dict(os.environ, TANDEM_ISA=cap)).stdout.split()[-1]
        assert out == body, cap
