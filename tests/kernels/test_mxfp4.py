"""MXFP4 (ggml type 39, gpt-oss's experts) as a native type: the torch reference equals gguf-py on every exponent
byte and nibble; the native dequantize equals it on every ISA body; the int8 GEMM's bodies (scalar, AVX2, VNNI,
AMX) and the VNNI GEMV are one arithmetic, bit for bit; linear_rows_q8act's own bodies are the float64 reference up
to fp32 summation order; a row's bits do not depend on how many rows ride with it on either side of small_m() (and
not at all where the GEMV has the type, nor in a model's linear, which runs the packed copy); the packed copy and
moe_experts give the GEMM's bits; a GGUF file's MXFP4 tensors load as QuantWeight blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.isa import isas, runnable
from tests.kernels.test_gemm_rows_q8act import gemm_bodies
from tests.kernels.test_kernels import assert_close_sum
from tests.kernels.test_quant_types import weights

from tandem import kernels
from tandem.kernels.quant import (MXFP4, MXFP4_VALUES, QuantWeight, dequantize_ref, e8m0_half_ref, linear_rows,
                                  linear_rows_q8act_ref, quantize_act_ref, small_m)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: "
                                f"{kernels.unavailable_reason()}")


FINITE_E = 253          # exponent bytes whose every value is finite: 12 x 2^(252 - 128) < 2^128 <= 12 x 2^125


def every_block() -> torch.Tensor:
    """GGUF rows [16, FINITE_E x 17]: block b of row r has exponent byte b and nibbles (i + r) % 16 (low) and
    (15 - i + r) % 16 (high) in byte i, so every exponent meets every nibble in both halves."""
    r, i = torch.arange(16)[:, None], torch.arange(16)
    qs = ((i + r) % 16) | (((15 - i + r) % 16) << 4)                              # [16 rows, 16 bytes]
    b = torch.cat([torch.arange(FINITE_E).view(1, FINITE_E, 1).expand(16, FINITE_E, 1),
                   qs[:, None, :].expand(16, FINITE_E, 16)], dim=2)
    return b.to(torch.uint8).reshape(16, -1).contiguous()


def test_e8m0_half_is_ggml_bits():
    e = torch.arange(256)
    assert torch.equal(e8m0_half_ref(e)[2:], torch.ldexp(torch.ones(254), e[2:] - 128.0))
    assert e8m0_half_ref(e)[:2].tolist() == [2.0 ** -128, 2.0 ** -127] and torch.isfinite(e8m0_half_ref(e)).all()


@pytest.mark.parametrize("isa", isas())
def test_dequantize_every_exponent_and_nibble_equals_gguf(isa):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    raw, k = every_block(), FINITE_E * 32
    ref = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType.MXFP4))
    q = QuantWeight.from_gguf(raw, MXFP4, k)
    assert q.data.shape == raw.shape and torch.equal(q.to_gguf(), raw)
    assert q.data[0, :FINITE_E].tolist() == list(range(FINITE_E))                  # the exponents apart
    assert torch.isfinite(ref).all() and (ref[:, :64] != 0).any()                  # subnormal scales too
    assert torch.equal(dequantize_ref(q.data, MXFP4, k), ref)
    assert torch.equal(torch.ops.tandem.dequantize(q.data, MXFP4, k, isa), ref)
    levels = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    assert torch.equal(ref[0, 130 * 32:130 * 32 + 16], levels * 4)                # e = 130: 2^2


def mxfp4(n: int, k: int, seed: int) -> QuantWeight:
    return weights(n, k, MXFP4, seed=seed)                                        # gguf-py's quantizer


ROWS = (1, 3, 16, 17, 96, 97, 300)              # a few, the GEMV's end, small_m() on either ISA, a GEMM size


def test_gemm_bodies_and_gemv_are_one_arithmetic():
    """Every GEMM body equals the scalar one bit for bit at every row count (padding tokens, N off the tiles, K
    off the 4-block steps); the VNNI GEMV (where it has the type) equals them up to its row limit."""
    k = 608
    q, bias = mxfp4(37, k, seed=1), torch.randn(37)
    x = torch.randn(max(ROWS), k) * 3
    x[0, : k // 2] = 0                                                            # zero halves: dx = 0
    gv = torch.ops.tandem.gemv_rows_q8act_max_rows(MXFP4)
    for m in ROWS + (small_m(), small_m() + 1):
        spec = torch.ops.tandem.gemm_rows_q8act(x[:m], q.data, MXFP4, k, bias, 0)
        for body in gemm_bodies():
            got = torch.ops.tandem.gemm_rows_q8act(x[:m], q.data, MXFP4, k, bias, body)
            assert torch.equal(got, spec), (m, body)
        if m <= gv:
            assert torch.equal(torch.ops.tandem.gemv_rows_q8act(x[:m], q.data, MXFP4, k, bias, 2), spec), m
        xq, d = quantize_act_ref(x[:m])
        xd, w = (xq.float() * d).reshape(m, k), dequantize_ref(q.data, MXFP4, k)
        assert_close_sum(spec, xd, w, linear_rows_q8act_ref(x[:m], q, bias))


@pytest.mark.parametrize("isa", isas(vnni=True))
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17])
def test_linear_rows_q8act_bodies_equal_reference(isa, m):
    """Each body (its own on scalar / AVX2, the GEMV on VNNI) against the float64 reference of the same rounding
    of x; K covering the 4-, 2- and 1-block steps."""
    for k in (32, 96, 608):
        q, bias = mxfp4(9, k, seed=m + k), torch.randn(9)
        x = torch.randn(m, k)
        xq, d = quantize_act_ref(x)
        xd, w = (xq.float() * d).reshape(m, k), dequantize_ref(q.data, MXFP4, k)
        y = torch.ops.tandem.linear_rows_q8act(x, q.data, MXFP4, k, bias, isa)
        assert_close_sum(y, xd, w, linear_rows_q8act_ref(x, q, bias))


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("m", [1, 2, 4, 5, 17])
def test_fp32_linear_rows_equals_reference(isa, m):
    """The fp32-activation op (fused path up to 4 rows, tiled past)."""
    q, bias = mxfp4(13, 320, seed=m), torch.randn(13)
    x, w = torch.randn(m, 320), dequantize_ref(q.data, MXFP4, 320)
    assert_close_sum(torch.ops.tandem.linear_rows(x, q.data, MXFP4, 320, bias, isa), x, w,
                     torch.nn.functional.linear(x, w, bias))


def test_a_row_has_the_same_bits_at_every_row_count_on_each_side():
    """linear_rows(int8_act=True): rows up to small_m() equal those of a small_m()-row call, rows past it those
    of a 300-row call; where the GEMV has the type, every row count gives the GEMM's bits."""
    k = 2880 // 32 * 32
    q, bias = mxfp4(21, k, seed=7), torch.randn(21)
    x = torch.randn(300, k)
    small, full = linear_rows(x[:small_m()], q, bias, int8_act=True), linear_rows(x, q, bias, int8_act=True)
    for m in (1, 2, 3, 5, 16, small_m()):
        assert torch.equal(linear_rows(x[:m], q, bias, int8_act=True), small[:m]), m
    for m in (small_m() + 1, 200, 300):
        assert torch.equal(linear_rows(x[:m], q, bias, int8_act=True), full[:m]), m
    if torch.ops.tandem.gemv_rows_q8act_max_rows(MXFP4):
        assert torch.equal(small, full[:small_m()])


def test_gguf_file_tensors_load_as_blocks(tmp_path):
    """A matrix and a 3-D expert block written in MXFP4 by gguf-py's writer and quantizer: tandem's reader keeps
    type 39, and the loader makes QuantWeights of its blocks (per expert) that dequantize as gguf-py does."""
    import gguf
    from gguf.quants import dequantize, quantize

    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.weights import _experts, _tensor
    rng = np.random.default_rng(0)
    mat, exps = rng.standard_normal((8, 64), dtype=np.float32), rng.standard_normal((3, 4, 96), dtype=np.float32)
    path = str(tmp_path / "mxfp4.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name, a in (("blk.0.attn_q.weight", mat), ("blk.0.ffn_gate_exps.weight", exps)):
        w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.MXFP4), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    t = {t.name: t for t in GGUFFile(path).tensors}
    q = _tensor(t["blk.0.attn_q.weight"], quantized=True)
    assert t["blk.0.attn_q.weight"].qtype == MXFP4 and isinstance(q, QuantWeight)
    assert (q.qtype, q.shape) == (MXFP4, (8, 64))
    expect = dequantize(quantize(mat, gguf.GGMLQuantizationType.MXFP4), gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(q.dequantize(), torch.from_numpy(expect))
    e = t["blk.0.ffn_gate_exps.weight"]
    shapes = {f"model.layers.0.mlp.experts.{i}.gate_proj.weight": (4, 96) for i in range(3)}
    parts = _experts(e, "model.layers.0.mlp.experts.gate_proj.weight", shapes, quantized=True)
    expect = dequantize(quantize(exps, gguf.GGMLQuantizationType.MXFP4), gguf.GGMLQuantizationType.MXFP4)
    for i in range(3):
        p = parts[f"model.layers.0.mlp.experts.{i}.gate_proj.weight"]
        assert p.qtype == MXFP4 and p.nbytes == 4 * 3 * 17
        assert torch.equal(p.dequantize(), torch.from_numpy(expect[i]))


def test_refusals():
    q = mxfp4(4, 64, seed=0)
    with pytest.raises(RuntimeError, match="w must be a contiguous uint8"):
        torch.ops.tandem.linear_rows_q8act(torch.randn(2, 64), q.data[:, :-1].contiguous(), MXFP4, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tandem.gemm_rows_q8act(torch.randn(2, 48), q.data, MXFP4, 48)
    if runnable((1,)):
        with pytest.raises(RuntimeError, match="MXFP4 need AVX-512 VNNI"):
            torch.ops.tandem.gemv_rows_q8act(torch.randn(2, 64), q.data, MXFP4, 64, None, 1)


def test_packed_copy_and_moe_experts_give_the_gemms_bits():
    """gpt-oss's decode path: each expert's packed copy (tandem.pack_gemv) gives the GEMM's bits on every body, and
    tandem.moe_experts over the stacked copies equals its composition from those ops (each chosen expert's gate_up,
    SiLU x up, down, weighted and summed in rank order), bit for bit."""
    ops, n_exp, hidden, inter = torch.ops.tandem, 4, 96, 64
    gate_up = [mxfp4(2 * inter, hidden, seed=10 + e) for e in range(n_exp)]
    down = [mxfp4(hidden, inter, seed=20 + e) for e in range(n_exp)]
    gus = torch.stack([ops.pack_gemv(q.data, MXFP4, hidden) for q in gate_up])
    downs = torch.stack([ops.pack_gemv(q.data, MXFP4, inter) for q in down])
    x = torch.randn(3, hidden)
    ids, w = torch.tensor([[0, 2], [3, 1], [2, 2]]), torch.rand(3, 2)
    for isa in runnable((1, 2), vnni=True):
        gemm = ops.gemm_rows_q8act(x, gate_up[1].data, MXFP4, hidden, None, 0)
        assert torch.equal(ops.gemv_packed_q8act(x, gus[1], MXFP4, hidden, 2 * inter, None, isa), gemm), isa
        expect = []
        for t in range(3):
            y = []
            for e in ids[t].tolist():
                gu = ops.gemv_packed_q8act(x[t:t + 1], gus[e], MXFP4, hidden, 2 * inter, None, isa)
                y.append(ops.gemv_packed_q8act(ops.silu_mul(gu, isa), downs[e], MXFP4, inter, hidden, None, isa)[0])
            expect.append(y[0] * w[t, 0] + y[1] * w[t, 1])
        got = ops.moe_experts(x, gus, MXFP4, downs, MXFP4, inter, ids, w, 0, isa)
        assert torch.equal(got, torch.stack(expect)), isa


def test_a_model_linear_gives_a_row_the_same_bits_at_every_row_count():
    """QLinear over an MXFP4 weight (int8 activations: its packed copy, the GEMV and the GEMM as the row count asks):
    a row alone, in a decode-sized step and in a prefill-sized one is the same bits, and close to the reference."""
    from tandem.model.linear import QLinear
    q, bias = mxfp4(40, 2880, seed=3), torch.randn(40)
    lin = QLinear(q, bias, int8_act=True)
    assert lin.packed is not None and lin.packed_rows > 0
    x = torch.randn(300, 2880)
    full = lin(x)
    for m in (1, 2, 7, 16, 17, small_m(), small_m() + 1, 299):
        assert torch.equal(lin(x[:m]), full[:m]), m
    assert float((full - linear_rows_q8act_ref(x, q, bias)).abs().max()) < 1e-3 * float(full.abs().max())
