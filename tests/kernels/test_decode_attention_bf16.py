"""bf16 products in the native decode op (csrc/decode_attention_bf16.inc; decode_attention="auto" | "bf16" | "fp32"):
on a bf16 cache, where the CPU has AVX512-BF16, the scores and the values run as vdpbf16ps on bf16 pairs (queries
times scale and each tile's probabilities rounded to bf16, every sum fp32). Checked: close to its float64
specification and to the fp32 reference within bf16's rounding; the op's invariants unchanged (a row's output is
the same bits alone, in any batch, with shared-prefix tasks on or off and at any thread count); the flag changes no
bit where the body cannot run; the engine option's choices and errors; both loops alike end to end."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels.attention import decode_attention_ref
from tests.helpers.isa import runnable

@pytest.fixture(scope="module")
def tiny_d32(tmp_path_factory) -> str:
    """A tiny Llama with head_dim 32 (the body's multiple; tiny_llama's 16 is not) as a Q8_0 GGUF."""
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    hf = make_tiny_model(tmp_path_factory.mktemp("tiny-d32"), "llama", hidden_size=128, intermediate_size=256)
    return str(write_tiny_gguf(tmp_path_factory.mktemp("q8d32") / "q8.gguf", hf, quant="Q8_0"))


native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
bf16_cpu = pytest.mark.skipif(not (kernels.available() and torch.ops.tandem.isa(2) == 2
                                   and torch.cpu._is_avx512_bf16_supported()), reason="this CPU lacks AVX512-BF16")


def _batch(own: list[int], prefix: int, h: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Rows of `own` keys each after a `prefix` of slots they all share (a radix-cache prefix), slots shuffled."""
    g = torch.Generator().manual_seed(seed)
    b, longest = len(own), max(own)
    total = prefix + b * longest
    perm = torch.randperm(total, generator=g)
    kv_index = torch.zeros(b, prefix + longest, dtype=torch.long)
    for r, n in enumerate(own):
        kv_index[r, :prefix] = perm[:prefix]
        kv_index[r, prefix:prefix + n] = perm[prefix + r * longest:prefix + r * longest + n]
    cache = torch.randn(total, 3, 2, kvh, d, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g) * 3
    return q, cache, kv_index, torch.tensor([prefix + n for n in own])


def _op(q, cache, kv_index, lens, bf16, isa=-1, window=0, share=True, threads=2, chunk_keys=-1):
    old_t, old = torch.get_num_threads(), torch.ops.tandem.shared_prefix_attention(-1)
    try:
        torch.set_num_threads(threads)
        torch.ops.tandem.shared_prefix_attention(int(share))
        return torch.ops.tandem.decode_attention(q, cache, 1, kv_index, lens, 0.125, isa, chunk_keys, window, bf16)
    finally:
        torch.ops.tandem.shared_prefix_attention(old)
        torch.set_num_threads(old_t)


def _spec(q, cache, kv_index, lens, window=0):
    """What the bf16-products body computes, in float64: scores of the bf16-rounded queries (times scale), their
    softmax, the output summed from the bf16-rounded probabilities over the sum of the unrounded ones."""
    kvh = cache.shape[3]
    g = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(lens[b])
        kv = cache[kv_index[b, max(0, n - window) if window else 0:n], 1].double()      # [n, 2, KVH, D]
        for i in range(q.shape[1]):
            s = kv[:, 0, i // g] @ (q[b, i] * 0.125).to(torch.bfloat16).double()
            e = torch.exp(s - s.max())
            out[b, i] = (e.float().to(torch.bfloat16).double()[:, None] * kv[:, 1, i // g]).sum(0) / e.sum()
    return out.float()


@native
@bf16_cpu
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 1, 256), (8, 8, 32)])
@pytest.mark.parametrize("window", [0, 45])
def test_bf16_products_match_their_specification(h, kvh, d, window):
    """Ragged rows on a shared prefix (odd tile lengths, a one-key row past the prefix, a row split in chunks):
    close to the specification, far closer than the fp32 body, within bf16's rounding of the fp32 reference. (Not
    to fp32 rounding: the op rounds each tile's probabilities against the running max, the specification against
    the row's: ~2^-9 a term.)"""
    q, cache, kv_index, lens = _batch([1, 24, 7, 330], 300, h, kvh, d, torch.bfloat16)
    got = _op(q, cache, kv_index, lens, True, window=window)
    fp32 = _op(q, cache, kv_index, lens, False, window=window)
    spec = _spec(q, cache, kv_index, lens, window)
    err, err_fp32 = (got - spec).abs(), (fp32 - spec).abs()
    assert err.mean() < 0.5 * err_fp32.mean() and err.max() < 5e-3
    # (scores of std ~6 at d = 256 here: a query's bf16 rounding moves the sharpest weights by ~2 %)
    torch.testing.assert_close(got, decode_attention_ref(q, cache, 1, kv_index, lens, 0.125, window),
                               rtol=0, atol=3e-2)


@native
@bf16_cpu
@pytest.mark.parametrize("own,prefix", [([24 + i for i in range(11)], 900), ([1, 2, 3, 400, 2000], 0),
                                        ([5, 5], 4000)])
def test_bf16_products_keep_the_ops_invariants(own, prefix):
    """With bf16 products a row's output is still the same bits with sharing on and off, at 1 and 2 threads,
    alone and in its batch: the body runs the same operations for a row wherever it sits."""
    q, cache, kv_index, lens = _batch(own, prefix, 9, 3, 64, torch.bfloat16, seed=len(own))
    before = torch.ops.tandem.shared_prefix_attention(-2)
    on = _op(q, cache, kv_index, lens, True)
    assert (torch.ops.tandem.shared_prefix_attention(-2) > before) == (prefix > 256)
    assert torch.equal(on, _op(q, cache, kv_index, lens, True, share=False))
    assert torch.equal(on, _op(q, cache, kv_index, lens, True, threads=1))
    for r in range(len(own)):
        assert torch.equal(on[r:r + 1], _op(q[r:r + 1], cache, kv_index[r:r + 1], lens[r:r + 1], True)), r
    forced = _op(q, cache, kv_index, lens, True, chunk_keys=96)
    assert torch.equal(forced, _op(q, cache, kv_index, lens, True, chunk_keys=96, share=False))


@native
@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 48)])
def test_bf16_products_elsewhere_run_the_fp32_body(dtype, d):
    """An fp32 or fp16 cache, a head_dim that is not a multiple of 32, the scalar and AVX2 bodies: the flag
    changes no bit (and on a CPU without AVX512-BF16 no case does)."""
    q, cache, kv_index, lens = _batch([40, 9, 300], 260, 6, 2, d, dtype)
    for isa in runnable():
        assert torch.equal(_op(q, cache, kv_index, lens, True, isa), _op(q, cache, kv_index, lens, False, isa))
    q, cache, kv_index, lens = _batch([40, 9, 300], 260, 6, 2, 64, torch.bfloat16)
    for isa in runnable((0, 1)):
        assert torch.equal(_op(q, cache, kv_index, lens, True, isa), _op(q, cache, kv_index, lens, False, isa))


@native
@bf16_cpu
def test_fused_op_passes_the_flag():
    """decode_attention_qkv_ (write, then attend) with bf16 products equals the write followed by the plain op's
    bf16 products, bit for bit."""
    q, cache, kv_index, lens = _batch([30, 31], 500, 9, 3, 64, torch.bfloat16)
    qkv = torch.randn(2, 15 * 64)
    loc = kv_index[torch.arange(2), lens - 1]
    a, b = cache.clone(), cache.clone()
    got = torch.ops.tandem.decode_attention_qkv_(qkv, a, 1, loc, kv_index, lens, 0.125, 9, -1, -1, 0, True)
    b[loc, 1, 0] = qkv[:, 9 * 64:12 * 64].reshape(2, 3, 64).to(torch.bfloat16)
    b[loc, 1, 1] = qkv[:, 12 * 64:].reshape(2, 3, 64).to(torch.bfloat16)
    assert torch.equal(a, b)
    want = torch.ops.tandem.decode_attention(qkv[:, :9 * 64].reshape(2, 9, 64), b, 1, kv_index, lens, 0.125, -1, -1,
                                             0, True)
    assert torch.equal(got, want.reshape(2, -1))


def test_decode_attention_is_checked():
    from tandem.config import EngineConfig
    with pytest.raises(ValueError, match="decode_attention must be"):
        EngineConfig(decode_attention="int8")
    with pytest.raises(ValueError, match="decode_attention='bf16' needs kernels='native' and kernels_act='int8'"):
        EngineConfig(decode_attention="bf16", kernels_act="fp32")
    assert EngineConfig().decode_attention == "auto" and "decode_attention" in EngineConfig.help()


@native
def test_decode_attention_choices(tiny_llama, tiny_d32, make_llm, tmp_path_factory, monkeypatch):
    """auto: bf16 products where the linears round (a quantized GGUF, kernels_act int8), the cache is bf16, the
    head_dim a multiple of 32 and the CPU has AVX512-BF16; "fp32" and the exact mode never; "bf16" where it cannot
    run is an error, not a silent fp32 run."""
    from tests.helpers.tiny_models import write_tiny_gguf
    q8 = tiny_d32
    d16 = str(write_tiny_gguf(tmp_path_factory.mktemp("q8d16") / "q8.gguf", tiny_llama, quant="Q8_0"))
    has = torch.ops.tandem.isa(2) == 2 and torch.cpu._is_avx512_bf16_supported() and kernels.isa() == "avx512"

    def decode_bf16(path, **kw):
        return make_llm(path, device_backend="inline", **kw).engine.executor.model_runner.model.decode_bf16
    assert decode_bf16(q8) == has
    assert not decode_bf16(q8, decode_attention="fp32")
    assert not decode_bf16(q8, kv_cache_dtype="float32")
    assert not decode_bf16(q8, kernels_act="fp32")
    assert not decode_bf16(tiny_llama)
    assert not decode_bf16(d16)                                        # head_dim 16
    with pytest.raises(ValueError, match="decode_attention='bf16' needs"):
        make_llm(q8, device_backend="inline", decode_attention="bf16", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="a multiple of 32"):
        make_llm(d16, device_backend="inline", decode_attention="bf16")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="decode_attention='bf16' needs"):
        make_llm(q8, device_backend="inline", decode_attention="bf16")


@native
@bf16_cpu
def test_both_loops_alike_with_bf16_decode_products(tiny_d32, make_llm):
    """Requests on a cached shared prefix, decoded with the bf16-products op (shared tasks, mixed steps, prompt
    chunks of up to small_m() tokens): the serial and overlap loops give the same greedy and seeded tokens, a
    prefix-cache hit gives what the fresh prompt gave, a prompt holding an earlier answer what it gives on an empty
    cache, and the first token's logprobs stay close to the fp32 op's."""
    from tests.helpers.engine_checks import run_with
    from tandem import SamplingParams
    from tandem.kernels.quant import small_m
    q8 = tiny_d32
    prefix = [(7 * i) % 200 + 3 for i in range(300)]
    prompts = [prefix + [(11 * i + 5 * j) % 250 + 2 for j in range(3 + i)] for i in range(12)]
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=1, ignore_eos=True)
              for i in range(12)]
    outs = {}
    for name, extra in (("serial", {}), ("overlap", {}), ("fp32", {"decode_attention": "fp32"})):
        llm = make_llm(q8, scheduler="serial" if name == "serial" else "overlap", device_backend="inline",
                       max_prefill_tokens=small_m(), **extra)
        assert llm.engine.executor.model_runner.model.decode_bf16 == (name != "fp32")
        llm.generate([prefix + [9]], SamplingParams(max_tokens=1), use_tqdm=False)
        outs[name] = [o.outputs[0] for o in run_with(llm, llm.engine.config.scheduler, prompts, params)]
        if name == "overlap":          # served again, now every prompt from the prefix cache
            again = [o.outputs[0] for o in run_with(llm, "overlap", prompts, params)]
            assert [o.token_ids for o in again] == [o.token_ids for o in outs[name]]
    assert [o.token_ids for o in outs["serial"]] == [o.token_ids for o in outs["overlap"]]
    # A prompt that ends with tokens a decode step produced: the prefix cache holds their KV from the decode op,
    # which a prompt never takes (its tokens attend by the extend op): the same bits as with no cache at all
    warm = make_llm(q8, device_backend="inline", max_prefill_tokens=small_m())
    cold = make_llm(q8, device_backend="inline", prefix_cache=False, max_prefill_tokens=small_m())
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    first = warm.generate([prompts[5]], greedy, use_tqdm=False)[0].outputs[0]
    longer = prompts[5] + first.token_ids[:6]
    a, b = (m.generate([longer], greedy, use_tqdm=False)[0].outputs[0] for m in (warm, cold))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    for a, b in zip(outs["overlap"], outs["fp32"]):
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        assert first_a.keys() == first_b.keys()
        assert all(abs(first_a[t] - first_b[t]) < 0.05 for t in first_a)
