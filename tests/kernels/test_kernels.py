"""tandem's native kernels against their torch references, on odd shapes, for every ISA body this CPU runs;
GGUF blocks kept by the loader against the dequantized weights; the real model's greedy parity with
transformers through both loops with kernels="native" and kernels="torch"."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.kernels.quant import (BLOCK_BYTES, K_QUANTS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0, QuantWeight,
                                  dequantize_ref, linear_rows, linear_rows_ref)
from tests.helpers.isa import isas

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: "
                                f"{kernels.unavailable_reason()}")
QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K}


def blocks(n: int, k: int, qtype: int, seed: int = 0) -> QuantWeight:
    """Random weights [n, k] quantized by gguf-py (the same code that wrote the GGUF files); K-quants (gguf-py
    has no quantizer for them): random super-blocks, every byte random but the fp16 d (and dmin), which are
    finite and small, so every 6-bit scale, min and quant pattern occurs."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        b = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
        d = (rng.standard_normal((n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)   # [n, ns, 4]
        if qtype == Q4_K:
            b[..., 0:4] = d                                       # d, dmin
        else:
            b[..., 208:210] = d[..., :2]                          # d
        return QuantWeight.from_gguf(torch.from_numpy(b.reshape(n, -1)), qtype, k)
    w = rng.standard_normal((n, k), dtype=np.float32)
    return QuantWeight.from_gguf(torch.from_numpy(quantize(w, GGMLQuantizationType(qtype))), qtype, k)


def k_of(k: int, qtype: int) -> int:
    """K rounded up to whole blocks of the type (256 weights for K-quants, 32 otherwise)."""
    qk = 256 if qtype in K_QUANTS else 32
    return -(-k // qk) * qk


def assert_close_sum(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to fp32 summation order: |y - ref| within K * 2^-20 of sum |x| |w| (a worst-case bound)."""
    bound = x.abs() @ w.abs().t() * (x.shape[1] * 2.0 ** -20) + 1e-6
    assert ((y - ref).abs() <= bound).all(), float((y - ref).abs().max())


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("isa", isas())
def test_dequantize_equals_gguf(name, isa):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    q = blocks(7, k_of(96, QTYPES[name]) * (2 if QTYPES[name] in K_QUANTS else 1), QTYPES[name])
    ref = torch.from_numpy(dequantize(q.to_gguf().numpy(), GGMLQuantizationType(q.qtype)))
    assert torch.equal(QuantWeight.from_gguf(q.to_gguf(), q.qtype, q.k).data, q.data)
    assert torch.equal(dequantize_ref(q.data, q.qtype, q.k), ref)
    assert torch.equal(torch.ops.tandem.dequantize(q.data, q.qtype, q.k, isa), ref)   # bit-identical weights


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (1, 7, 576), (2, 5, 64), (3, 33, 96), (4, 9, 608), (17, 64, 160),
                                     (64, 13, 1536), (200, 3, 512),
                                     (5, 258, 64)])
def test_linear_rows_equals_reference(name, isa, m, n, k):
    """K-quant cases take K up to whole 256-weight super-blocks (256, 768, 1536, 512)."""
    k = k_of(k, QTYPES[name])
    q = blocks(n, k, QTYPES[name], seed=m + n)
    x, bias = torch.randn(m, k), torch.randn(n)
    w = dequantize_ref(q.data, q.qtype, k)
    for b in (None, bias):
        y = torch.ops.tandem.linear_rows(x, q.data, q.qtype, k, b, isa)
        ref = linear_rows_ref(x, q, b)
        assert y.shape == (m, n)
        assert_close_sum(y, x, w, ref)


@pytest.mark.parametrize("qtype, k", [(Q4_1, 224), (Q4_K, 512), (Q6_K, 256)])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 65, 200])
def test_linear_rows_dispatch_equals_reference(m, qtype, k):
    """The Python entry point: in-kernel up to SMALL_M rows, dequantize + fp32 GEMM past it."""
    from tandem.kernels.quant import small_m
    assert 1 <= small_m() < 200
    q = blocks(45, k, qtype, seed=m)
    x = torch.randn(m, k)
    w, ref = dequantize_ref(q.data, q.qtype, q.k), linear_rows_ref(x, q)
    assert_close_sum(linear_rows(x, q), x, w, ref)
    assert_close_sum(linear_rows(x.t().contiguous().t(), q), x, w, ref)          # a strided x


# int8 activations (kernels_act="int8", the default): tests/kernels/test_int8_act.py


def test_rows_cat_and_errors():
    a, b = blocks(5, 64, Q8_0), blocks(3, 64, Q8_0, seed=1)
    ab = QuantWeight.cat([a, b])
    assert torch.equal(ab.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert QuantWeight.cat([a, blocks(3, 64, Q4_0)]) is None
    ids = torch.tensor([4, 0, 4])
    assert torch.equal(a.rows(ids), a.dequantize()[ids])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tandem.linear_rows(torch.randn(1, 40), a.data, Q8_0, 40)
    with pytest.raises(RuntimeError, match="bytes a row"):
        torch.ops.tandem.linear_rows(torch.randn(1, 64), a.data, Q4_1, 64)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.tandem.linear_rows(torch.randn(1, 64), a.data, Q4_K, 64)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        torch.ops.tandem.linear_rows(torch.randn(1, 64), a.data, 16, 64)          # IQ2_XXS
    assert a.data.shape[1] == 2 * BLOCK_BYTES[Q8_0]


# ------------------------------------------------------------------------------------------- the loader
def test_quantized_state_equals_dense_weights():
    """The kept GGUF blocks (q/k rows un-permuted on the bytes) dequantize to the fp32 weights bit for bit."""
    from tandem.model.loader import load_weights, resolve_model
    src = resolve_model(None)
    quant, dense = load_weights(src, quantized=True), load_weights(src)
    assert set(quant) == set(dense)
    kinds = {type(v).__name__ for v in quant.values()}
    assert kinds == {"QuantWeight", "Tensor"}
    for name, v in quant.items():
        got = v.dequantize() if isinstance(v, QuantWeight) else v
        assert torch.equal(got, dense[name]), name
    qbytes = sum(v.nbytes for v in quant.values() if isinstance(v, QuantWeight))
    assert qbytes * 5 < sum(t.numel() * 4 for t in dense.values())


def test_k_quant_gguf_kept_and_greedy_equal_torch(tmp_path, make_llm, monkeypatch):
    """A tiny random Llama written as Q4_K_M (Q4_K, Q6_K head, layer 0 mixing Q4_K q/k with Q6_K v): the loader
    keeps both types as blocks, and kernels="native" decodes greedily as kernels="torch" (dequantized weights)."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem import SamplingParams
    from tandem.model.loader import load_weights, resolve_model
    skip_gguf_tokenizer_build(monkeypatch)                        # transformers' GGUF tokenizer build is slow
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", hf_dir, quant="Q4_K_M", with_tokenizer=False)
    state = load_weights(resolve_model(path, cache_dir=str(tmp_path / "cache")), quantized=True)
    qtypes = {k: v.qtype for k, v in state.items() if isinstance(v, QuantWeight)}
    assert qtypes["lm_head.weight"] == qtypes["model.layers.0.self_attn.v_proj.weight"] == Q6_K
    assert qtypes["model.layers.0.self_attn.q_proj.weight"] == qtypes["model.layers.1.self_attn.v_proj.weight"] == Q4_K
    assert len(qtypes) == 2 + 7 * 2
    outs = []
    for opt in ("native", "torch"):
        llm = make_llm(path, kernels=opt, kernels_act="fp32",
                       cache_dir=str(tmp_path / "cache"), device_backend="inline")
        prompts = [llm.tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):"]]
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        outs.append([o.token_ids for o in res])
    assert outs[0] == outs[1]


# ------------------------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def hf_reference():
    from tests.model.test_parity import _hf_from_gguf
    return _hf_from_gguf()


@pytest.mark.parametrize("kernels_opt", ["native", "torch"])
def test_real_model_parity_both_loops(kernels_opt, hf_reference, smollm, make_llm):
    from tests.helpers.engine_checks import run_with
    from tandem import SamplingParams
    from tests.model.test_parity import assert_parity, hf_greedy
    llm = smollm if kernels_opt == "native" else make_llm(None, kernels="torch")     # smollm: the exact mode
    assert llm.engine.config.kernels == kernels_opt
    tok = llm.tokenizer
    prompts = [tok.encode(t) for t in ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]]
    refs = [hf_greedy(hf_reference, p, 12) for p in prompts]
    for scheduler in ("serial", "overlap"):
        outs = run_with(llm, scheduler, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for o, (ref_ids, scores) in zip(outs, refs):
            assert_parity(o.token_ids, ref_ids, scores)


# attention: tests/kernels/test_decode_attention.py


TINY_LAYERS = {"llama": dict(hidden_size=256, intermediate_size=512),
               "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64),
               "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)}


@pytest.mark.parametrize("arch", list(TINY_LAYERS))
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_fused_decode_layers_equal_op_by_op(arch, quant, tmp_path, make_llm, monkeypatch):
    """A decode step's layers as one decode_layer_ op each give, bit for bit, the op-by-op layers' tokens and
    logprobs, in both activation modes, also where the qkv projection mixes block types (Q4_K_M's layer 0:
    Q4_K q / k beside a Q6_K v, three parts), with Qwen3's QK-norm, and for an MoE layer the op's attention half
    (its experts run after it)."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem import SamplingParams
    skip_gguf_tokenizer_build(monkeypatch)
    hf_dir = make_tiny_model(tmp_path / "hf", arch, **TINY_LAYERS[arch])
    path = write_tiny_gguf(tmp_path / f"t-{quant}.gguf", hf_dir, quant=quant, with_tokenizer=False)
    for act in ("int8", "fp32"):
        llm = make_llm(path, kernels_act=act, cache_dir=str(tmp_path / "cache"), device_backend="inline",
                       prefix_cache=False)
        layers = llm.engine.executor.model_runner.model.layers
        assert all("blocks" in layer for layer in layers)
        assert any("moe" in layer for layer in layers) == (arch == "qwen3_moe")
        for layer in layers:
            assert len(layer["blocks"][0]) == len(layer["qkv"].parts) + (1 if "moe" in layer else 3)
        assert len(layers[0]["qkv"].parts) == (3 if quant == "Q4_K_M" else 1)
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        runs = []
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.token_ids, o.outputs[0].logprobs) for o in outs])
            for layer in layers:
                layer.pop("blocks", None)
        assert runs[0] == runs[1]
        llm.shutdown()


# ------------------------------------------------------------------------------------------- fused layer ops
@pytest.mark.parametrize("t", [1, 5, 37])
def test_fused_layer_ops_equal_llama_reference(t):
    from tandem.model.layer_ops import rms_norm
    from tandem.model.rope import apply_rope
    e, heads, kvh, d = 96, 3, 1, 32
    x, delta, w = torch.randn(t, e), torch.randn(t, e), torch.randn(e)
    torch.testing.assert_close(torch.ops.tandem.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    x2 = x.clone()
    got = torch.ops.tandem.add_rms_norm_(x2, delta, w, 1e-6)
    torch.testing.assert_close(x2, x + delta)
    torch.testing.assert_close(got, rms_norm(x + delta, w, 1e-6))
    gu = torch.randn(t, 2 * e)
    torch.testing.assert_close(torch.ops.tandem.silu_mul(gu), F.silu(gu[:, :e]) * gu[:, e:])
    cos, sin = torch.randn(50, d), torch.randn(50, d)
    positions = torch.randint(0, 50, (t,))
    qkv = torch.randn(t, (heads + 2 * kvh) * d)
    ref_q = apply_rope(qkv[:, :heads * d].view(t, heads, d), cos[positions, None], sin[positions, None])
    ref_k = apply_rope(qkv[:, heads * d:(heads + kvh) * d].view(t, kvh, d), cos[positions, None],
                       sin[positions, None])
    v = qkv[:, (heads + kvh) * d:].clone()
    torch.ops.tandem.rope_(qkv, cos, sin, positions, heads + kvh, d)
    torch.testing.assert_close(qkv[:, :heads * d].view(t, heads, d), ref_q)
    torch.testing.assert_close(qkv[:, heads * d:(heads + kvh) * d].view(t, kvh, d), ref_k)
    assert torch.equal(qkv[:, (heads + kvh) * d:], v)


@pytest.mark.parametrize("t", [1, 5, 37])
def test_gemma_qwen3_layer_ops_equal_reference(t):
    """GeGLU (tanh GELU) and QK-norm in place on the fused qkv (q heads by one weight row each, then k heads;
    v untouched), against the torch reference the model's torch path runs; head_dim 256 as Gemma 3's."""
    from tandem.model.layer_ops import rms_norm
    e, heads, kvh, d = 96, 4, 1, 256
    gu = torch.randn(t, 2 * e) * 3
    torch.testing.assert_close(torch.ops.tandem.gelu_tanh_mul(gu), F.gelu(gu[:, :e], approximate="tanh") * gu[:, e:])
    qkv = torch.randn(t, (heads + 2 * kvh) * d + 7)[:, :(heads + 2 * kvh) * d]        # rows strided
    w = torch.randn(heads + kvh, d)
    ref = rms_norm(qkv[:, :(heads + kvh) * d].reshape(t, heads + kvh, d), w, 1e-6).reshape(t, -1)
    v = qkv[:, (heads + kvh) * d:].clone()
    torch.ops.tandem.head_rms_norm_(qkv, w, 1e-6)
    torch.testing.assert_close(qkv[:, :(heads + kvh) * d], ref)
    assert torch.equal(qkv[:, (heads + kvh) * d:], v)
    with pytest.raises(RuntimeError, match="head_rms_norm_"):
        torch.ops.tandem.head_rms_norm_(qkv, torch.randn(heads + 2 * kvh + 1, d), 1e-6)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("features", [1, 7, 16, 37, 1536])
def test_gated_activations_every_body(isa, features):
    """silu_mul and gelu_tanh_mul on every ISA body equal torch's SiLU / tanh GELU times up: widths with and
    without a last part-register, large and tiny gates (exp's clamps), rows strided; the AVX-512 and AVX2 bodies
    give the same bits; a row's result is the same bits alone and in a batch."""
    g = torch.Generator().manual_seed(features)
    gu = (torch.randn(9, 2 * features + 3, generator=g) * 6)[:, :2 * features]          # rows strided
    gu[0, :features] = torch.linspace(-120.0, 120.0, features)
    gate, up = gu[:, :features], gu[:, features:]
    for op, ref in ((torch.ops.tandem.silu_mul, F.silu(gate) * up),
                    (torch.ops.tandem.gelu_tanh_mul, F.gelu(gate, approximate="tanh") * up)):
        got = op(gu, isa)
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-5)
        assert torch.equal(op(gu[4:5], isa), got[4:5])
        if isa == 2:
            assert torch.equal(got, op(gu, 1))


def test_gated_activation_argument_checks():
    for op in (torch.ops.tandem.silu_mul, torch.ops.tandem.gelu_tanh_mul):
        with pytest.raises(RuntimeError, match="odd feature count"):
            op(torch.randn(2, 5))
        with pytest.raises(RuntimeError, match="fp32"):
            op(torch.randn(2, 4, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="fp32"):
            op(torch.randn(8))


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("vocab", [1, 7, 8, 17, 33, 1000])
def test_race_argmax_equals_torch(isa, vocab):
    """The sampler's race (noise, divide, subtract, argmax in one pass) equals the torch reference: ties (first
    index), -inf masks (grammar, top-k) and NaN (the largest, as torch.argmax) included; its noise equals the
    reference's hash exactly, up to the log's last bits."""
    from tandem.sampler import race_argmax, race_noise
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g) * 4
    x[1] = 0.5                                                       # all tied: index 0 without noise
    x[2, vocab // 2:] = -float("inf")                                # masked tail
    x[3] = -float("inf")                                             # all masked: index 0, as torch
    x[4, vocab - 1] = x[4].max() + 100                               # the last element wins (SIMD tail)
    x[5, (2 * vocab) // 3] = float("nan")
    x[6, :] = x[6].round()                                           # many exact ties after the divide
    t = torch.rand(9, generator=g) + 0.25
    seeds = torch.randint(0, 2 ** 62, (9,), generator=g)
    for tt, ss in ((None, None), (t, None), (None, seeds), (t, seeds)):
        ref = race_argmax(x, tt, ss, native=False)
        got = torch.ops.tandem.race_argmax(x, tt, ss, isa)
        assert got.tolist() == ref.tolist(), (tt is not None, ss is not None)
    native, ref = torch.ops.tandem.race_noise(seeds, vocab, isa), race_noise(seeds, vocab)
    assert torch.allclose(native, ref, rtol=2e-6, atol=2e-6), float((native - ref).abs().max())


def test_race_noise_is_exponential_and_row_pure():
    """E = exp(log E) ~ Exp(1) (mean 1, P(E > 1) = 1/e), rows depend on their seed alone, and rows differ."""
    from tandem.sampler import race_noise
    seeds = torch.tensor([7, 8, 7, 2 ** 40 + 7])
    e = torch.ops.tandem.race_noise(seeds, 200_000).exp()
    assert torch.equal(e[0], e[2]) and not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[3])
    assert abs(float(e[0].mean()) - 1) < 0.01 and abs(float((e[0] > 1).float().mean()) - math.exp(-1)) < 0.005
    assert torch.equal(race_noise(seeds[:1], 50), race_noise(seeds, 50)[:1])


def test_race_noise_of_one_is_clamped():
    """v == 1 gives E == 0, whose log would turn a masked token's score into NaN, which argmax picks: the
    noise keeps E >= FLT_MIN. Found by search: a (seed, token) whose hash's top 24 bits are all ones."""
    from tandem.sampler import SamplingBatch, _mix, race_noise, sample
    j = torch.arange(1 << 20)
    for seed in range(1000):
        x = _mix(_mix((j * 0x9E3779B9 + seed) & 0xFFFFFFFF))
        hit = ((x >> 8) == 0xFFFFFF).nonzero()
        if len(hit):
            tok = int(hit[0])
            break
    else:
        pytest.fail("no v == 1 in the search range")
    seeds = torch.tensor([seed])
    for noise in (race_noise(seeds, tok + 1), torch.ops.tandem.race_noise(seeds, tok + 1)):
        assert noise[0, tok] == math.log(torch.finfo(torch.float32).tiny)
    logits = torch.full((1, tok + 1), -float("inf"))
    logits[0, :3] = 0.0                                              # the hit token is masked
    p = SamplingBatch.from_host(np.ones(1), np.ones(1), np.full(1, -1), np.zeros(1), np.array([seed]),
                                torch.device("cpu"))
    assert sample(logits, p, native=True).item() < 3 and sample(logits, p, native=False).item() < 3


def test_native_sampling_equals_the_torch_path():
    """sample(native=True) draws the same tokens as the torch path: greedy, tempered, top-k/p and min-p rows
    in one batch over a SmolLM2-sized vocabulary."""
    from tandem.sampler import SamplingBatch, draw_seeds, sample
    n, vocab = 12, 49152
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 3
    temperature = np.array([0.0, 1.0, 0.7, 1.3] * 3)
    top_k = np.array([-1] * 4 + [20] * 4 + [-1] * 4)
    top_p = np.array([1.0] * 8 + [0.9] * 4)
    min_p = np.array([0.0] * 10 + [0.05] * 2)
    seeds = draw_seeds(np.arange(n), np.full(n, 5))
    for rows in (slice(None), slice(1, 4)):                          # mixed greedy/sampled, all sampled
        p = SamplingBatch.from_host(temperature[rows], top_p[rows], top_k[rows], min_p[rows], seeds[rows],
                                    torch.device("cpu"))
        assert sample(logits[rows], p, native=True).tolist() == sample(logits[rows], p, native=False).tolist()
