"""tandem.packed_gather: rows of a weight read out of its packed copy (tandem.pack_gemv's layouts: Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K and Q4_0, Q4_1, Q5_0, Q8_0, MXFP4) are tandem.dequantize's rows of the row layout bit for bit, on
every
ISA body, for any rows (N off the 16-row groups, the last group's rows, repeated rows), so a tied model's token
lookup in its LM head's packed copy changes no bit. Bad arguments are refused with a clear error."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.isa import runnable
from tests.kernels.test_gemm_rows_q8act import _weight

from tandem import kernels
from tandem.kernels.quant import MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, packed_gather

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
T = torch.ops.tandem


def _index(n: int, seed: int) -> torch.Tensor:
    """Every row once in a random order, then the first and last rows, repeats and the last group's rows."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randperm(n, generator=g), torch.tensor([0, n - 1, n - 1, 0, n // 2, n // 2]),
                      torch.arange(max(0, n - 5), n)])


def _check(qtype: int, n: int, k: int, seed: int) -> None:
    q = _weight(n, k, qtype, seed=seed)
    packed = T.pack_gemv(q.data, qtype, k)
    idx = _index(n, seed)
    for isa in runnable():                                 # dequantize's bodies: scalar, AVX2, AVX-512
        got = T.packed_gather(packed, qtype, k, n, idx, isa)
        assert torch.equal(got, T.dequantize(q.data[idx], qtype, k, isa)), isa
    assert torch.equal(packed_gather(packed, qtype, k, n, idx), q.rows(idx))
    assert torch.equal(packed_gather(packed, qtype, k, n, idx.int()), q.rows(idx))       # int32 ids too


@pytest.mark.parametrize("name, qtype", [("Q2_K", Q2_K), ("Q3_K", Q3_K), ("Q4_K", Q4_K), ("Q5_K", Q5_K),
                                         ("Q6_K", Q6_K)])
@pytest.mark.parametrize("n, k", [(37, 256), (203, 512), (37, 768), (16, 1536), (1, 256), (203, 3072)])
def test_k_quant_rows_are_dequantizes_bit_for_bit(name, qtype, n, k):
    _check(qtype, n, k, seed=n + k)


@pytest.mark.parametrize("name, qtype", [("Q4_0", Q4_0), ("Q4_1", Q4_1), ("Q5_0", Q5_0), ("Q8_0", Q8_0),
                                         ("MXFP4", MXFP4)])
@pytest.mark.parametrize("n, k", [(37, 32), (203, 96), (17, 576)])
def test_block_type_rows_are_dequantizes_bit_for_bit(name, qtype, n, k):
    """The 32-weight types: where the packed copy takes every row count (AVX2), their heads drop the rows too."""
    _check(qtype, n, k, seed=n + k)


def test_linear_rows_lookup_rows_is_the_same_held_or_released():
    """QLinear.lookup_rows: the row layout's rows while held, the packed copy's after release_rows(), the same
    bits (a Q4_0 / Q4_1 / Q5_0 / Q8_0 head releases its rows only where its copy takes every row count: forced here)."""
    from tandem.model.linear import ALL_ROWS, QLinear
    if T.gemv_packed_q8act_max_rows(Q6_K) == 0:
        pytest.skip("no packed copy on a CPU without AVX2")
    idx = _index(45, 3)
    for qtype in (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K, Q8_0, Q5_0, Q4_1, Q4_0):
        q = _weight(45, 512, qtype, seed=qtype)
        lin = QLinear(q, int8_act=True)
        held = lin.lookup_rows(idx)
        lin.packed_rows = ALL_ROWS
        lin.release_rows()
        assert not lin.holds_rows and lin.parts[0].data.numel() == 0
        assert torch.equal(lin.lookup_rows(idx), held) and torch.equal(held, q.rows(idx)), qtype


def test_refusals():
    q = _weight(37, 512, Q6_K, seed=1)
    packed = T.pack_gemv(q.data, Q6_K, 512)
    with pytest.raises(RuntimeError, match=r"index\[1\] = 37 is out of range for a weight of 37 rows"):
        T.packed_gather(packed, Q6_K, 512, 37, torch.tensor([36, 37]))
    with pytest.raises(RuntimeError, match=r"index\[0\] = -1 is out of range"):
        T.packed_gather(packed, Q6_K, 512, 37, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K"):
        T.packed_gather(packed, Q5_1, 512, 37, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="multiple of 256"):
        T.packed_gather(packed, Q6_K, 320, 37, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="for N = 50 and K = 512"):             # another weight's shape
        T.packed_gather(packed, Q6_K, 512, 50, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="for N = 37 and K = 512"):             # another type's layout
        T.packed_gather(packed, Q4_K, 512, 37, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="for N = 37 and K = 512"):
        T.packed_gather(packed, Q3_K, 512, 37, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="1-D integer"):
        T.packed_gather(packed, Q6_K, 512, 37, torch.tensor([0.0]))
    with pytest.raises(RuntimeError, match="1-D integer"):
        T.packed_gather(packed, Q6_K, 512, 37, torch.tensor([[0]]))
    assert T.packed_gather(packed, Q6_K, 512, 37, torch.tensor([], dtype=torch.long)).shape == (0, 512)
