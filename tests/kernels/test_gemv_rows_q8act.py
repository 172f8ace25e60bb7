"""The int8 GEMV with the GEMM's arithmetic (tandem.gemv_rows_q8act; Q4_1 and Q8_0, an AVX-512 VNNI and an AVX2
body; Q5_0, Gemma 3's main type, and MXFP4, gpt-oss's experts, the VNNI body only): its rows equal gemm_rows_q8act's
bit for bit, so linear_rows_q8act
(which runs it up to gemv_rows_q8act_max_rows() rows and the GEMM past them, where that is not 0) gives a row the same
bits at every row count, and SmolLM2 (Q4_1 + a Q8_0 head) decodes a request alone as in a batch where both its types
have it (VNNI). Bad inputs are refused with a clear error."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.isa import runnable
from tests.kernels.test_gemm_rows_q8act import _weight
from tests.kernels.test_quant_types import whole

from tandem import kernels
from tandem.kernels.quant import MXFP4, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, linear_rows

pytestmark = pytest.mark.skipif(not kernels.available() or torch.ops.tandem.isa(-1) < 1,
                                reason="needs the native kernels on a CPU with AVX2")
TYPES = {"Q4_1": Q4_1, "Q8_0": Q8_0, "Q5_0": Q5_0, "MXFP4": MXFP4}
BODIES = runnable((1, 2), vnni=True)                                     # AVX2, and VNNI where it is here
VNNI_ONLY = {Q5_0, MXFP4}                                                       # types the AVX2 body does not have


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m, n, k", [(1, 13, 224), (3, 25, 576), (5, 40, 608), (16, 33, 1536), (7, 16, 32),
                                     (2, 17, 96), (9, 3, 160), (4, 1, 64)])
def test_gemv_equals_the_gemm_bit_for_bit(name, m, n, k):
    """Any rows of x, N off the 16-row groups, K with every tail of the 4-block (Q4_1) or 2-block (Q8_0) steps,
    zero halves, with and without bias."""
    qtype = TYPES[name]
    k = whole(k, qtype)
    q = _weight(n, k, qtype, seed=m + n)
    x, bias = torch.randn(m, k) * 3, torch.randn(n)
    x[0, : k // 2] = 0
    for b in (None, bias):
        gemm = torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, b)
        for isa in BODIES if qtype not in VNNI_ONLY else BODIES[1:]:
            assert torch.equal(torch.ops.tandem.gemv_rows_q8act(x, q.data, qtype, k, b, isa), gemm), isa
        assert torch.equal(torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, b, 2), gemm)     # the VNNI body too
        assert torch.equal(torch.ops.tandem.gemm_rows_q8act(x, q.data, qtype, k, b, 1), gemm)     # and the AVX2 one


@pytest.mark.parametrize("name", TYPES)
def test_a_row_has_the_same_bits_at_every_row_count(name):
    """linear_rows_q8act and the Python entry point: row r alone, in 2..300-row calls (the GEMV, the GEMM from
    gemv_rows_q8act_max_rows() + 1, past small_m()) and under one thread is the same bits."""
    qtype = TYPES[name]
    if torch.ops.tandem.gemv_rows_q8act_max_rows(qtype) == 0:
        pytest.skip("linear_rows_q8act keeps its own body for this type on this CPU (AVX2: Q4_1, Q8_0, Q5_0)")
    k = whole(608, qtype)
    q = _weight(37, k, qtype, seed=3)
    x, bias = torch.randn(300, k), torch.randn(37)
    full = linear_rows(x, q, bias, int8_act=True)
    for m in (1, 2, 5, 8, 9, 16, 17, 37, 64, 96, 97, 200):
        assert torch.equal(linear_rows(x[:m], q, bias, int8_act=True), full[:m]), m
        assert torch.equal(torch.ops.tandem.linear_rows_q8act(x[:m], q.data, qtype, k, bias), full[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.tandem.linear_rows_q8act(x[299:], q.data, qtype, k, bias), full[299:])
    finally:
        torch.set_num_threads(threads)


def test_rows_and_refusals():
    assert torch.ops.tandem.gemv_rows_q8act_max_rows(Q4_K) == 0         # the K8 contract: k8_spec.cpp
    assert torch.ops.tandem.gemv_rows_q8act_max_rows(Q6_K) == 0
    if torch.ops.tandem.isa(-1) < 2:                           # AVX2: Q4_1 and Q8_0 keep linear_rows_q8act's faster body
        assert torch.ops.tandem.gemv_rows_q8act_max_rows(Q4_1) == torch.ops.tandem.gemv_rows_q8act_max_rows(Q8_0) == 0
    q = _weight(4, 256, Q6_K, seed=0)
    with pytest.raises(RuntimeError, match="Q4_1, Q8_0, Q5_0 or MXFP4"):
        torch.ops.tandem.gemv_rows_q8act(torch.randn(2, 256), q.data, Q6_K, 256)
    q = _weight(4, 256, Q8_0, seed=0)
    with pytest.raises(RuntimeError, match="needs AVX2"):                    # isa 0: the scalar cap
        torch.ops.tandem.gemv_rows_q8act(torch.randn(2, 256), q.data, Q8_0, 256, None, 0)
    q5 = _weight(4, 256, Q5_0, seed=0)
    with pytest.raises(RuntimeError, match="Q5_0 and MXFP4 need AVX-512 VNNI"):       # isa 1: the AVX2 body
        torch.ops.tandem.gemv_rows_q8act(torch.randn(2, 256), q5.data, Q5_0, 256, None, 1)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.tandem.gemv_rows_q8act(torch.randn(2, 128), q.data, Q8_0, 256)
    assert torch.ops.tandem.gemv_rows_q8act(torch.randn(0, 256), q.data, Q8_0, 256).shape == (0, 4)


def test_smollm2_decodes_a_row_the_same_alone_and_in_a_batch():
    """The default model: a greedy request's tokens and logprobs alone equal its own in a batch of 40 requests
    (decode steps of 40 rows: the GEMM, past gemv_rows_q8act_max_rows(); alone: the GEMV). Prefill chunks of 16 tokens
    keep every step within the attention's own per-row path (steps of more than 96 new tokens attend by
    SDPA, whose sums differ: README, "Exact mode and the int8 default")."""
    if not (torch.ops.tandem.gemv_rows_q8act_max_rows(Q4_1) and torch.ops.tandem.gemv_rows_q8act_max_rows(Q8_0)):
        pytest.skip("SmolLM2's Q4_1 and Q8_0 take linear_rows_q8act's own body up to 16 rows on this CPU (AVX2)")
    from tandem import LLM, SamplingParams
    llm = LLM(device_backend="inline", max_running_requests=48, max_prefill_tokens=16)
    try:
        p = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
        prompts = [f"Item {i}: the quick brown fox" for i in range(40)]
        alone = llm.generate(prompts[:1], p, use_tqdm=False)[0].outputs[0]
        batch = llm.generate(prompts, p, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == batch.token_ids and alone.logprobs == batch.logprobs
    finally:
        llm.shutdown()
