"""The K8 contract of Q4_K / Q5_K / Q6_K weights (csrc/k8_spec.cpp): x rounded per 256-weight super-block (llama.cpp's
Q8_K) and a super-block's dot product one integer. The packed GEMV's bodies equal the scalar specification bit for
bit in test_gemv_packed_q8act.py; here: x's rounding is the same bytes whichever body rounds it (TANDEM_ISA caps
the body in a fresh process), the specification is the float64 product of the rounded operands up to fp32 rounding,
and the rounding is per super-block, not per half."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tests.kernels.test_gemm_rows_q8act import _weight

from tandem import kernels
from tandem.kernels.quant import Q4_1, Q4_K, Q5_K, Q6_K, act_block, dequantize_ref, linear_rows_q8act_ref

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
T = torch.ops.tandem
TYPES = (Q4_K, Q5_K, Q6_K)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = """
import sys, torch
from tandem import kernels
from tests.kernels.test_gemm_rows_q8act import _weight
x = torch.load(sys.argv[1])
out = {}
for qt in (12, 13, 14):
    q = _weight(40, 512, qt, seed=qt)
    out[qt] = torch.ops.tandem.gemm_rows_q8act(x, q.data, qt, 512, None)
torch.save(out, sys.argv[2])
"""


@pytest.mark.parametrize("cap", ["scalar", "avx2"])
def test_x_rounding_is_the_same_bytes_on_every_body(tmp_path, cap):
    """quantize_k8_x's scalar, AVX2 and AVX-512 bodies: the specification's outputs in a process capped to one
    body equal this process's (the best body here), so each body rounds x to the same quants, scales and sums."""
    x = torch.randn(9, 512) * 3
    x[2, :256] = 0                                                       # a zero super-block: d = 0
    x[3, 256:] *= 1e-30                                                  # tiny values
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "TANDEM_ISA": cap, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "x.pt"), str(tmp_path / "y.pt")], env=env,
                   check=True, cwd=ROOT, timeout=300)
    got = torch.load(tmp_path / "y.pt")
    for qt in TYPES:
        q = _weight(40, 512, qt, seed=qt)
        assert torch.equal(got[qt], T.gemm_rows_q8act(x, q.data, qt, 512, None)), (cap, qt)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_specification_is_the_product_of_the_rounded_operands(qtype):
    """Within fp32 rounding of the float64 product of x rounded per super-block and the dequantized weight; and
    measurably not x rounded per half (the per-half contract of the other types)."""
    assert act_block(qtype) == 256 and act_block(Q4_1) == 16
    q = _weight(24, 768, qtype, seed=5)
    x = torch.randn(6, 768)
    x[:, ::37] *= 40                                                     # outliers: per-256 and per-16 differ
    y = T.gemm_rows_q8act(x, q.data, qtype, 768, None)
    ref = linear_rows_q8act_ref(x, q)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))
    xb = x.reshape(6, -1, 16)
    d = xb.abs().amax(-1, keepdim=True) / 127
    per_half = (torch.round(xb / d) * d).reshape(6, 768).double() @ dequantize_ref(q.data, qtype, 768).double().t()
    assert float((y.double() - per_half).abs().max()) > 1e-3 * float(per_half.abs().max())
