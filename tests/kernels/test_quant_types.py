"""The GGUF types added to the native kernels after the first five (Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, F16, BF16):
bit-identical dequantization against gguf-py on every ISA body this CPU runs, the quantized linear (fp32 and,
for Q5_0 / Q5_1, int8 activations) against its torch reference on odd shapes, the row regrouping's round trip,
and tiny Llamas written as a real Q4_K_M mix (a width that is not a multiple of 256 keeps most matrices as
Q5_0), with every K-quant, and as F16 / BF16, loaded without dequantizing anything."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.isa import isas
from tests.kernels.test_kernels import assert_close_sum

from tandem import kernels
from tandem.kernels.quant import (BF16, BLOCK_BYTES, BLOCK_WEIGHTS, F16, K_QUANTS, MXFP4, NATIVE_QTYPES, Q2_K, Q3_K,
                                  Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QuantWeight, dequantize_ref, linear_rows,
                                  linear_rows_ref, small_m)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: "
                                f"{kernels.unavailable_reason()}")
NEW = {"Q5_0": Q5_0, "Q5_1": Q5_1, "Q5_K": Q5_K, "Q3_K": Q3_K, "Q2_K": Q2_K, "F16": F16, "BF16": BF16,
       "MXFP4": MXFP4}
# Where a block's fp16 scales sit (d, and m / dmin): every other byte of a random block is valid.
SCALE_BYTES = {Q5_0: slice(0, 2), Q5_1: slice(0, 4), Q5_K: slice(0, 4), Q3_K: slice(108, 110), Q2_K: slice(80, 84)}


def random_blocks(n: int, k: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """GGUF rows [n, K / block weights * block bytes] of random bytes but finite, small fp16 scales, so every
    quant, high-bit and 6-bit scale pattern occurs. F16 / BF16: random finite halves (subnormals included)."""
    rng = np.random.default_rng(seed)
    if qtype in (F16, BF16):
        h = rng.integers(0, 1 << 16, (n, k), dtype=np.uint16)
        exp = 0x7c00 if qtype == F16 else 0x7f80                  # all-ones exponent: inf / nan
        h[(h & exp) == exp] &= ~np.uint16(0x4000)
        return torch.from_numpy(h.view(np.uint8))
    b = rng.integers(0, 256, (n, k // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == MXFP4:                              # every exponent byte is finite: small ones, weights ~0.01-1
        b[..., 0] = rng.integers(118, 128, b.shape[:2], dtype=np.uint8)
        return torch.from_numpy(b.reshape(n, -1))
    s = SCALE_BYTES[qtype]
    b[..., s] = (rng.standard_normal((*b.shape[:2], (s.stop - s.start) // 2)) * 0.01).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def weights(n: int, k: int, qtype: int, seed: int = 0) -> QuantWeight:
    """Random weights quantized by gguf-py where it has a quantizer (not for K-quants), random blocks otherwise."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    if qtype in K_QUANTS:
        return QuantWeight.from_gguf(random_blocks(n, k, qtype, seed), qtype, k)
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    rows = quantize(w, GGMLQuantizationType(qtype)).view(np.uint8)            # F16 comes as float16 [n, k]
    return QuantWeight.from_gguf(torch.from_numpy(rows), qtype, k)


def whole(k: int, qtype: int) -> int:
    qk = BLOCK_WEIGHTS[qtype]
    return -(-k // qk) * qk


def test_new_types_are_native():
    assert {Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, F16, BF16, MXFP4} <= NATIVE_QTYPES


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("source", ["random", "gguf-py"])
def test_dequantize_bit_identical_to_gguf(name, isa, source):
    """Random valid blocks (and gguf-py's own quantization) through from_gguf / to_gguf, the torch reference and
    the native op: every weight equals gguf-py's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    qtype = NEW[name]
    if source == "gguf-py" and qtype in K_QUANTS:
        pytest.skip("gguf-py has no K-quant quantizer")
    k = whole(96, qtype) * 3
    raw = random_blocks(7, k, qtype, seed=isa) if source == "random" else weights(7, k, qtype, seed=isa).to_gguf()
    ref = torch.from_numpy(dequantize(raw.numpy().view(np.float16) if qtype == F16 else raw.numpy(),
                                      GGMLQuantizationType(qtype)))
    q = QuantWeight.from_gguf(raw, qtype, k)
    assert q.data.shape == raw.shape and torch.equal(q.to_gguf(), raw)
    assert torch.equal(dequantize_ref(q.data, qtype, k), ref)
    assert torch.equal(torch.ops.tandem.dequantize(q.data, qtype, k, isa), ref)
    out = torch.empty(7, k)
    torch.ops.tandem.dequantize_out(q.data, qtype, k, out, isa)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (1, 7, 576), (1, 65, 1536), (2, 5, 64), (3, 33, 96), (4, 9, 608),
                                     (17, 64, 160), (64, 13, 1536), (200, 3, 512), (5, 258, 64)])
def test_linear_rows_equals_reference(name, isa, m, n, k):
    """Odd shapes; K rounded up to whole blocks (K-quants: 256, 768, 1536, 512); M = 1-4 runs the fused path,
    more rows the tiled one."""
    qtype = NEW[name]
    k = whole(k, qtype)
    q = weights(n, k, qtype, seed=m + n)
    x, bias = torch.randn(m, k), torch.randn(n)
    w = dequantize_ref(q.data, qtype, k)
    for b in (None, bias):
        y = torch.ops.tandem.linear_rows(x, q.data, qtype, k, b, isa)
        assert y.shape == (m, n)
        assert_close_sum(y, x, w, linear_rows_ref(x, q, b))


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("m", [1, 3, 17, 64, 200])
def test_linear_rows_dispatch_equals_reference(name, m):
    """The Python entry point (in-kernel up to small_m() rows, dequantize + fp32 GEMM past it)."""
    assert small_m() < 200
    qtype = NEW[name]
    q = weights(37, whole(320, qtype), qtype, seed=m)
    x = torch.randn(m, q.k)
    assert_close_sum(linear_rows(x, q), x, dequantize_ref(q.data, qtype, q.k), linear_rows_ref(x, q))


def test_cat_and_rows():
    a, b = weights(5, 96, Q5_1), weights(3, 96, Q5_1, seed=1)
    ab = QuantWeight.cat([a, b])
    assert torch.equal(ab.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    ids = torch.tensor([4, 0, 2])
    assert torch.equal(a.rows(ids), a.dequantize()[ids])


def _greedy(make_llm, path, tmp_path, kernels: str) -> list[list[int]]:
    """Greedy token ids of two prompts with kernels= "native" (the exact mode) or "torch" (the reference)."""
    from tandem import SamplingParams
    llm = make_llm(path, kernels=kernels, kernels_act="fp32",
                   cache_dir=str(tmp_path / "cache"), device_backend="inline")
    prompts = [llm.tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):"]]
    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in res]


def test_q4_k_m_mix_kept_and_greedy_equal_torch(tmp_path, make_llm, monkeypatch):
    """A tiny random Llama of width 192 written as llama.cpp writes Q4_K_M for it: matrices with K = 192 fall back
    to Q5_0 (Q8_0 for the Q6_K ones: the LM head, layer 0's attn_v), ffn_down (K = 512) stays Q4_K / Q6_K. Every
    matrix loads as blocks of its own type, and kernels="native" decodes greedily as kernels="torch"."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem.model.loader import load_weights, resolve_model
    skip_gguf_tokenizer_build(monkeypatch)
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=192, intermediate_size=512)
    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", hf_dir, quant="Q4_K_M", with_tokenizer=False)
    state = load_weights(resolve_model(path, cache_dir=str(tmp_path / "cache")), quantized=True)
    matrices = {k: v for k, v in state.items() if k.endswith(".weight") and "norm" not in k}
    assert all(isinstance(v, QuantWeight) for v in matrices.values()), \
        [k for k, v in matrices.items() if not isinstance(v, QuantWeight)]
    qtypes = {k: v.qtype for k, v in matrices.items()}
    assert set(qtypes.values()) == {Q5_0, Q8_0, Q4_K, Q6_K}
    assert qtypes["model.layers.1.self_attn.q_proj.weight"] == qtypes["model.embed_tokens.weight"] == Q5_0
    assert qtypes["lm_head.weight"] == qtypes["model.layers.0.self_attn.v_proj.weight"] == Q8_0
    assert qtypes["model.layers.0.mlp.down_proj.weight"] == Q6_K
    assert qtypes["model.layers.1.mlp.down_proj.weight"] == Q4_K
    assert _greedy(make_llm, path, tmp_path, "native") == _greedy(make_llm, path, tmp_path, "torch")


def test_k_quant_mix_kept_and_greedy_equal_torch(tmp_path, make_llm, monkeypatch):
    """Every K-quant in one tiny Llama (Q2_K gate / up, Q3_K q / k / o and embedding, Q4_K / Q5_K attn_v and
    ffn_down, Q6_K head: the Q2_K and Q3_K_M mixes), kept as blocks; layer 0's fused qkv mixes Q3_K and Q5_K, and
    kernels="native" decodes greedily as kernels="torch"."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem.model.loader import load_weights, resolve_model
    skip_gguf_tokenizer_build(monkeypatch)
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(tmp_path / "tiny-k-mix.gguf", hf_dir, quant="K_MIX", with_tokenizer=False)
    state = load_weights(resolve_model(path, cache_dir=str(tmp_path / "cache")), quantized=True)
    qtypes = {k: v.qtype for k, v in state.items() if isinstance(v, QuantWeight)}
    assert len(qtypes) == 2 + 7 * 2
    assert set(qtypes.values()) == {Q2_K, Q3_K, Q4_K, Q5_K, Q6_K}
    assert qtypes["model.layers.0.self_attn.v_proj.weight"] == qtypes["model.layers.1.mlp.down_proj.weight"] == Q5_K
    assert qtypes["model.layers.1.mlp.up_proj.weight"] == Q2_K and qtypes["model.embed_tokens.weight"] == Q3_K
    assert _greedy(make_llm, path, tmp_path, "native") == _greedy(make_llm, path, tmp_path, "torch")



@pytest.mark.parametrize("quant, qtype", [("F16", F16), ("BF16", BF16)])
def test_half_gguf_kept_and_greedy_equal_torch(quant, qtype, tmp_path, make_llm, monkeypatch):
    """An F16 / BF16 file: every matrix stays halves (half the bytes of the fp32 it was dequantized to), and
    kernels="native" decodes greedily as kernels="torch"."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem import SamplingParams
    from tandem.model.loader import load_weights, resolve_model
    skip_gguf_tokenizer_build(monkeypatch)
    path = write_tiny_gguf(tmp_path / f"tiny-{quant}.gguf", make_tiny_model(tmp_path / "hf", "llama"), quant=quant,
                           with_tokenizer=False)
    state = load_weights(resolve_model(path, cache_dir=str(tmp_path / "cache")), quantized=True)
    dense = load_weights(resolve_model(path, cache_dir=str(tmp_path / "cache")))
    for name, v in state.items():
        if name.endswith(".weight") and "norm" not in name:
            assert isinstance(v, QuantWeight) and v.qtype == qtype, name
            assert torch.equal(v.dequantize(), dense[name]), name
    outs = []
    for opt in ("native", "torch"):
        llm = make_llm(path, kernels=opt, kernels_act="fp32",
                       cache_dir=str(tmp_path / "cache"), device_backend="inline")
        res = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
        outs.append([o.token_ids for o in res])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["Q5_K", "Q2_K", "Q5_0"])
def test_column_shards_cut_on_whole_blocks(name):
    """Tensor parallelism's column split keeps blocks where the cut falls on a block of the type (256 weights for
    K-quants) and dequantizes otherwise: a cut 32 weights into a super-block must not slice its bytes."""
    from tandem.model.shard import cols
    qtype = NEW[name]
    q = weights(3, 768, qtype)
    dense, cut = q.dequantize(), []
    kept = cols(q, 256, 512, cut, "o")
    assert isinstance(kept, QuantWeight) and cut == [] and torch.equal(kept.dequantize(), dense[:, 256:512])
    part = cols(q, 32, 288, cut, "o")
    assert torch.equal(part.dequantize() if isinstance(part, QuantWeight) else part, dense[:, 32:288])
    assert cut == ([] if qtype == Q5_0 else ["o"])
