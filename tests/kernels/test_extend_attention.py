"""The native extend attention (csrc/extend_attention.cpp): a step's new tokens, many per row, each attending its
row's keys up to its own position, read in place from the paged cache. Against its specification (every token a
decode row over its causal keys: gather + SDPA) on every ISA body and cache dtype, with ragged rows, cached
prefixes, sliding windows, GQA and head sizes of the supported models, strided queries and a 4k context; its
argument checks; and end to end in the exact mode, the same greedy tokens and logprobs (1e-4) as the torch path
with a cached shared prefix, chunked prefill and mixed steps, in both loops."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels.attention import extend_attention, extend_attention_ref
from tests.helpers.isa import isas, runnable

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")


def _case(new, cached, h, kvh, d, dtype, seed=0):
    """Rows with `new` tokens after `cached` keys each; slots shuffled over a cache with 2 layers."""
    g = torch.Generator().manual_seed(seed)
    b, lk = len(new), max(n + c for n, c in zip(new, cached))
    slots = b * lk + 3
    cache = torch.randn(slots + 1, 2, 2, kvh, d, generator=g).to(dtype)
    kv_index = torch.randperm(slots, generator=g)[:b * lk].view(b, lk)
    tok_row = torch.cat([torch.full((n,), r) for r, n in enumerate(new)])
    positions = torch.cat([torch.arange(c, c + n) for n, c in zip(new, cached)])
    qkv = torch.randn(len(tok_row), (h + 2 * kvh) * d, generator=g)
    return qkv[:, :h * d].view(-1, h, d), cache, kv_index, tok_row, positions      # q: strided rows, as the model's


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 1, 256), (14, 2, 128), (8, 8, 32), (3, 3, 20)])
@pytest.mark.parametrize("window", [0, 37])
def test_matches_reference(isa, dtype, h, kvh, d, window):
    """Ragged rows (fresh, on cached keys, a one-token row, a row longer than a key block and than a task's tokens):
    every output within fp32 rounding of the reference."""
    q, cache, kv_index, tok_row, pos = _case([5, 70, 1, 130], [0, 100, 7, 3], h, kvh, d, dtype)
    got = torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, window, isa)
    want = extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("isa", isas())
def test_long_context_and_many_rows(isa):
    """A 256-token chunk on 3,900 cached keys beside 32 rows of 24 tokens on one shared 900-key prefix (the
    same slots): within fp32 rounding of the reference."""
    q, cache, kv_index, tok_row, pos = _case([256], [3900], 9, 3, 64, torch.bfloat16, seed=1)
    got = torch.ops.tandem.extend_attention(q, cache, 0, kv_index, tok_row, pos, 0.125, 0, isa)
    torch.testing.assert_close(got, extend_attention_ref(q, cache, 0, kv_index, tok_row, pos, 0.125), rtol=1e-5,
                               atol=1e-5)
    q, cache, kv_index, tok_row, pos = _case([24] * 32, [900] * 32, 9, 3, 64, torch.bfloat16, seed=2)
    kv_index[:, :900] = kv_index[0, :900]                                 # one prefix, read by every row
    got = torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, 0, isa)
    torch.testing.assert_close(got, extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, 0.125), rtol=1e-5,
                               atol=1e-5)


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, "q8_0"])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (14, 2, 128), (3, 3, 20)])
@pytest.mark.parametrize("window", [0, 37])
def test_a_tokens_bits_do_not_depend_on_its_chunk(isa, dtype, h, kvh, d, window):
    """Prompt tokens attend by this op under batch invariance (model/attention_paths.py): a token's output is the
    same bits alone, with its whole prompt in one call, and in any cut of the prompt into chunks beside other
    rows' tokens (key blocks at absolute positions; a column's sums its own). bf16 products too where the CPU
    has them (a bf16 cache)."""
    if dtype == "q8_0" and d % 32:
        pytest.skip("q8_0 blocks need head_dim % 32 == 0")
    q, cache, kv_index, tok_row, pos = _case([150, 40, 1], [70, 0, 300], h, kvh, d,
                                             torch.float32 if dtype == "q8_0" else dtype, seed=5)
    if dtype == "q8_0":
        from tandem.kernels.kv_quant import quantize
        cache = quantize(cache.float())
    op = torch.ops.tandem.extend_attention
    for bf16 in ([False, True] if dtype == torch.bfloat16 else [False]):
        whole = op(q, cache, 1, kv_index, tok_row, pos, 0.125, window, isa, bf16)
        alone = torch.cat([op(q[t:t + 1], cache, 1, kv_index, tok_row[t:t + 1], pos[t:t + 1], 0.125, window, isa,
                              bf16) for t in range(q.shape[0])])
        assert torch.equal(alone, whole)
        t0, pieces = 0, []
        for n in (1, 63, 64, 22):                # the first row's 150 tokens in chunks, each beside row 1's tokens
            sel = torch.cat([torch.arange(t0, t0 + n), torch.arange(150 + t0 // 8, 150 + t0 // 8 + 9)])
            pieces.append(op(q[sel], cache, 1, kv_index, tok_row[sel], pos[sel], 0.125, window, isa, bf16)[:n])
            t0 += n
        assert torch.equal(torch.cat(pieces), whole[:150])


@native
def test_thread_count_does_not_change_a_bit():
    q, cache, kv_index, tok_row, pos = _case([300, 40], [500, 0], 9, 3, 64, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@native
def test_bad_arguments_are_clear_errors():
    q, cache, kv_index, tok_row, pos = _case([4, 3], [2, 0], 4, 2, 16, torch.float32)
    op = torch.ops.tandem.extend_attention
    bad = [
        ((q.double(), cache, 0, kv_index, tok_row, pos, 1.0), "q must be fp32"),
        ((q, cache, 5, kv_index, tok_row, pos, 1.0), "layer out of range"),
        ((q, cache, 0, kv_index, tok_row + 2, pos, 1.0), "tok_row"),
        ((q, cache, 0, kv_index, tok_row, pos + 100, 1.0), "positions"),
        ((q, cache, 0, kv_index.clone().fill_(10 ** 6), tok_row, pos, 1.0), "kv_index"),
        ((q, cache, 0, kv_index, tok_row[:-1], pos, 1.0), "tok_row and positions"),
        ((q[:, :3], cache, 0, kv_index, tok_row, pos, 1.0), "multiple of the KV heads"),
    ]
    for args, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            op(*args)
    with pytest.raises(RuntimeError, match="window"):
        op(q, cache, 0, kv_index, tok_row, pos, 1.0, -1)


@native
@pytest.mark.parametrize("scheduler", ["serial", "overlap"])
def test_engine_matches_the_torch_path(tiny_llama, make_llm, monkeypatch, scheduler):
    """16 requests on a cached 120-token prefix with 20-65 own tokens, chunked (max_prefill_tokens 256) and mixed
    with running decode rows, exact mode: native kernels (long chunks by the extend op) give the torch path's
    greedy tokens, and logprobs within 1e-4."""
    from tandem import SamplingParams
    from tests.helpers.engine_checks import count_attention_calls
    calls = count_attention_calls(monkeypatch, "extend_attention")
    prefix = [(7 * i) % 200 + 3 for i in range(120)]
    prompts = [prefix + [(11 * i + 5 * j) % 250 + 2 for j in range(20 + 3 * i)] for i in range(16)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = {}
    for k in ("native", "torch"):
        llm = make_llm(tiny_llama, scheduler=scheduler, kernels=k, device_backend="inline", kernels_act="fp32",
                       max_prefill_tokens=256, batch_invariant=False)
        llm.generate([prefix + [9]], SamplingParams(max_tokens=1), use_tqdm=False)    # the prefix is cached
        first = llm.generate(prompts[:2], sp, use_tqdm=False)
        rest = llm.generate(prompts, sp, use_tqdm=False)
        outs[k] = [o.outputs[0] for o in first + rest]
        assert (calls["n"] > 0) == (k == "native")
        calls["n"] = 0
    for a, b in zip(outs["native"], outs["torch"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)


# ------------------------------------------------------------------------------------ bf16 products (AVX512-BF16)
bf16_cpu = pytest.mark.skipif(not (kernels.available() and torch.ops.tandem.isa(2) == 2
                                   and torch.cpu._is_avx512_bf16_supported()), reason="this CPU lacks AVX512-BF16")


def _bf16_products_ref(q, cache, layer, kv_index, tok_row, pos, scale, window=0):
    """What the bf16-products task computes, in float64: scores of the bf16-rounded queries (times scale), their
    softmax, the output summed from the bf16-rounded probabilities over the fp32 sum of the unrounded ones."""
    kvh, d = cache.shape[3], cache.shape[4]
    g = q.shape[1] // kvh
    out = torch.empty(q.shape[0], q.shape[1], d, dtype=torch.float64)
    for t in range(q.shape[0]):
        p = int(pos[t])
        first = max(0, p + 1 - window) if window else 0
        kv = cache[kv_index[tok_row[t], first:p + 1], layer].double()            # [n, 2, KVH, D]
        for i in range(q.shape[1]):
            qb = (q[t, i] * scale).to(torch.bfloat16).double()
            s = kv[:, 0, i // g] @ qb
            e = torch.exp(s - s.max())
            eb = e.float().to(torch.bfloat16).double()
            out[t, i] = (eb[:, None] * kv[:, 1, i // g]).sum(0) / e.sum()
    return out.float().reshape(q.shape[0], -1)


@native
@bf16_cpu
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 1, 256), (8, 8, 32)])
@pytest.mark.parametrize("window", [0, 37])
def test_bf16_products_match_their_specification(h, kvh, d, window):
    """Ragged rows with odd key blocks (a one-token row, a 65-key row, cached prefixes), on a bf16 cache: close to the
    bf16-products specification, far closer than the fp32 body (which the flag must not run), and within bf16's
    rounding of the fp32 reference. (Not to fp32 rounding: the op rounds each block's probabilities against the
    block's running max, the specification against the row's; the two roundings differ by ~2^-9 a term.)"""
    q, cache, kv_index, tok_row, pos = _case([5, 70, 1, 130], [0, 100, 7, 3], h, kvh, d, torch.bfloat16)
    got = torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, window, 2, True)
    fp32 = torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, window, 2, False)
    spec = _bf16_products_ref(q, cache, 1, kv_index, tok_row, pos, 0.125, window)
    err, err_fp32 = (got - spec).abs(), (fp32 - spec).abs()
    assert err.mean() < 0.25 * err_fp32.mean() and err.max() < 5e-3
    ref = extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, 0.125, window)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-2)


@native
@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 20)])
def test_bf16_products_elsewhere_run_the_fp32_body(dtype, d):
    """An fp32 or fp16 cache, or a head_dim that is not a multiple of 16: the flag changes no bit (and on a CPU
    without AVX512-BF16 no cache does)."""
    q, cache, kv_index, tok_row, pos = _case([40, 9], [30, 0], 6, 2, d, dtype)
    for isa in runnable():
        a = torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, 0, isa, True)
        assert torch.equal(a, torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, 0, isa))


def test_prefill_attention_is_checked():
    from tandem.config import EngineConfig
    with pytest.raises(ValueError, match="prefill_attention must be"):
        EngineConfig(prefill_attention="fp16")
    with pytest.raises(ValueError, match="needs kernels='native' and kernels_act='int8'"):
        EngineConfig(prefill_attention="bf16", kernels_act="fp32")
    assert EngineConfig().prefill_attention == "auto" and "prefill_attention" in EngineConfig.help()


@native
def test_prefill_attention_choices(tiny_llama, make_llm, tmp_path_factory, monkeypatch):
    """auto: bf16 products where the linears round (a quantized GGUF, kernels_act int8), the cache is bf16 and the
    CPU has AVX512-BF16; "fp32" and the exact mode never; "bf16" where it cannot run is an error, not a silent
    fp32 run."""
    from tests.helpers.tiny_models import write_tiny_gguf
    q8 = str(write_tiny_gguf(tmp_path_factory.mktemp("q8x") / "q8.gguf", tiny_llama, quant="Q8_0"))
    has = torch.ops.tandem.isa(2) == 2 and torch.cpu._is_avx512_bf16_supported() and kernels.isa() == "avx512"

    def extend_bf16(path, **kw):
        return make_llm(path, device_backend="inline", **kw).engine.executor.model_runner.model.attention.extend_bf16
    assert extend_bf16(q8, prefill_act="int8") == has
    assert not extend_bf16(q8, prefill_act="int8", prefill_attention="fp32")
    assert not extend_bf16(q8, prefill_act="int8", kv_cache_dtype="float32")
    assert not extend_bf16(q8, kernels_act="fp32")
    assert not extend_bf16(tiny_llama)
    with pytest.raises(ValueError, match="prefill_attention='bf16' needs"):
        make_llm(q8, device_backend="inline", prefill_act="int8", prefill_attention="bf16", kv_cache_dtype="float32")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="prefill_attention='bf16' needs"):
        make_llm(q8, device_backend="inline", prefill_act="int8", prefill_attention="bf16")


@native
@bf16_cpu
def test_both_loops_alike_with_bf16_products(tiny_llama, make_llm, tmp_path_factory):
    """Prompts prefilled in long chunks by the bf16-products op, chunked and mixed with decode rows, on a cached
    prefix: the serial and overlap loops give the same tokens; and the logprobs stay close to the fp32 op's."""
    from tests.helpers.engine_checks import run_with
    from tandem import SamplingParams
    from tandem.kernels.quant import small_m
    from tests.helpers.tiny_models import write_tiny_gguf
    q8 = str(write_tiny_gguf(tmp_path_factory.mktemp("q8y") / "q8.gguf", tiny_llama, quant="Q8_0"))
    prefix = [(7 * i) % 200 + 3 for i in range(150)]
    prompts = [prefix + [(11 * i + 5 * j) % 250 + 2 for j in range(small_m() + 10 + 7 * i)] for i in range(6)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    kw = dict(prefill_act="int8", max_prefill_tokens=2 * small_m() + 60, device_backend="inline", batch_invariant=False)
    outs = {}
    for name, extra in (("serial", {}), ("overlap", {}), ("fp32", {"prefill_attention": "fp32"})):
        llm = make_llm(q8, scheduler="serial" if name == "serial" else "overlap", **kw, **extra)
        assert llm.engine.executor.model_runner.model.attention.extend_bf16 == (name != "fp32")
        llm.generate([prefix + [9]], SamplingParams(max_tokens=1), use_tqdm=False)
        outs[name] = [o.outputs[0] for o in run_with(llm, llm.engine.config.scheduler, prompts, sp)]
    assert [o.token_ids for o in outs["serial"]] == [o.token_ids for o in outs["overlap"]]
    for a, b in zip(outs["overlap"], outs["fp32"]):
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        assert first_a.keys() == first_b.keys()
        assert all(abs(first_a[t] - first_b[t]) < 0.05 for t in first_a)
