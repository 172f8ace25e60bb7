"""Long prefill chunks in bf16 (prefill_act): a quantized linear's bf16 copy against the fp32 reference, the
row split that keeps a mixed step's decode rows on the int8 kernels, the "auto" choice and the option's
errors, and the engine end to end: both loops alike, decode rows untouched by a prefill in their step, and
prompt logprobs close to the int8 path's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import SamplingParams, kernels

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")


def _weights(qtypes):
    from tests.kernels.test_kernels import blocks               # gguf-py's quantizer; random super-blocks for K-quants
    return [blocks(n, 256, q, seed=i) for i, (q, n) in enumerate(qtypes)]


@native
@pytest.mark.parametrize("qtypes", [[(3, 48)], [(8, 40)], [(12, 32)], [(14, 24)], [(12, 32), (14, 16)]],
                         ids=["q4_1", "q8_0", "q4_k", "q6_k", "q4_k+q6_k"])
@pytest.mark.parametrize("bias", [False, True])
def test_bulk_is_the_bf16_gemm_of_the_dequantized_weight(qtypes, bias):
    from tandem.model.linear import QLinear, run_rows
    parts = _weights(qtypes)
    n = sum(p.shape[0] for p in parts)
    b = torch.randn(n) if bias else None
    lin = QLinear(parts if len(parts) > 1 else parts[0], b, int8_act=True)
    x = torch.randn(200, 256)
    assert run_rows(lin, x, 0).equal(lin(x))            # no bf16 copy: the int8 path, whatever bulk_from says
    lin.make_bf16()
    dense = torch.cat([p.dequantize() for p in parts])
    ref = F.linear(x, dense, b)
    got = lin.bulk(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # bf16 inputs (8-bit mantissas) and a bf16 output: a few parts in a thousand of the row's scale
    assert ((got - ref).abs().amax(1) <= 2e-2 * ref.abs().amax(1) + 1e-3).all()
    assert not got.equal(lin(x))                       # it is another path than the int8 kernels
    # run_rows: the rows before bulk_from keep the int8 path's bits, the rest are bulk()'s
    for b0 in (0, 17, 199, 200):
        y = run_rows(lin, x, b0)
        assert y[:b0].equal(lin(x[:b0]) if b0 else y[:0])
        assert y[b0:].equal(lin.bulk(x[b0:]) if b0 < 200 else y[200:])


def test_prefill_act_is_checked():
    from tandem.config import EngineConfig
    with pytest.raises(ValueError, match="prefill_act must be"):
        EngineConfig(prefill_act="fp16")
    with pytest.raises(ValueError, match="needs kernels='native' and kernels_act='int8'"):
        EngineConfig(prefill_act="bf16", batch_invariant=False, kernels_act="fp32")
    with pytest.raises(ValueError, match="needs kernels='native' and kernels_act='int8'"):
        EngineConfig(prefill_act="int8", kernels="torch")
    assert EngineConfig().prefill_act == "auto" and "prefill_act" in EngineConfig.help()
    with pytest.raises(ValueError, match="batch_invariant=False"):        # bf16 rows follow the chunk's size
        EngineConfig(prefill_act="bf16")


@pytest.fixture(scope="module")
def q8_gguf(tiny_llama, tmp_path_factory):
    from tests.helpers.tiny_models import write_tiny_gguf
    return str(write_tiny_gguf(tmp_path_factory.mktemp("q8") / "q8.gguf", tiny_llama, quant="Q8_0"))


@native
def test_auto_and_explicit_choices(tiny_llama, q8_gguf, make_llm):
    """auto: bf16 where the CPU has AMX-BF16 tiles; explicit choices win; the exact mode and unquantized
    weights never take it, and asking for it there is an error, not a silent fp32 run."""
    amx = (torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported()
           and kernels.isa() == "avx512")                       # (TANDEM_ISA=avx2 makes it the AVX2 engine's)
    for kw, want in [({}, amx), ({"prefill_act": "bf16"}, True), ({"prefill_act": "int8"}, False),
                     ({"kernels_act": "fp32"}, False)]:
        model = make_llm(q8_gguf, device_backend="inline", batch_invariant=False, **kw
                         ).engine.executor.model_runner.model
        assert model.prefill_bf16 == want, kw
        assert (model.layers[0]["gate_up"].bf16 is not None) == want, kw
    assert not make_llm(tiny_llama, device_backend="inline").engine.executor.model_runner.model.prefill_bf16
    assert not make_llm(q8_gguf, device_backend="inline").engine.executor.model_runner.model.prefill_bf16  # invariant
    with pytest.raises(ValueError, match="needs a quantized"):
        make_llm(tiny_llama, device_backend="inline", prefill_act="bf16", batch_invariant=False)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 250, (length,), generator=g).tolist() for _ in range(n)]


@native
def test_both_loops_alike_with_bf16_prefill(q8_gguf, make_llm):
    """Prompts long enough that every prefill step is a bf16 chunk, chunked (max_prefill_tokens) and mixed
    with decode rows: the serial and overlap loops give the same tokens, greedy and seeded. One engine a loop:
    on one engine the second run hits the prefix cache and re-prefills a short tail with the int8 kernels, not
    inside a bf16 chunk (another rounding, by design: _bulk_from), which with AVX2's small_m() of 16 changed a
    greedy token of the first prompt."""
    from tests.helpers.engine_checks import run_with
    from tandem.kernels.quant import small_m
    kw = dict(prefill_act="bf16", batch_invariant=False, max_prefill_tokens=2 * small_m() + 40,
              mixed_prefill_tokens=small_m() + 20)
    prompts = _prompts(5, small_m() + 50, 1) + _prompts(2, 3 * small_m(), 2)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)] * 4
    serial = [o.outputs[0].token_ids for o in run_with(make_llm(q8_gguf, **kw), "serial", prompts,
                                                          params[:len(prompts)])]
    overlap = [o.outputs[0].token_ids for o in run_with(make_llm(q8_gguf, **kw), "overlap", prompts,
                                                           params[:len(prompts)])]
    assert serial == overlap


@native
def test_decode_rows_untouched_by_a_bf16_prefill_in_their_step(q8_gguf, make_llm):
    """A long prompt arriving in chunks rides in mixed steps with the short requests' decode rows: those rows
    stay on the int8 kernels (run_rows, and the SiLU of their own row count), so their tokens and logprobs are
    the bits they get without it. The short prompts fill the first step alone in both runs (120 tokens, a
    bf16 chunk itself), so their prefill is the same step either way."""
    from tandem.kernels.quant import small_m
    assert small_m() < 120
    kw = dict(prefill_act="bf16", batch_invariant=False, max_prefill_tokens=120, mixed_prefill_tokens=120,
              prefix_cache=False)
    short = _prompts(3, 40, 3)
    long = _prompts(1, 300, 4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = make_llm(q8_gguf, **kw).generate(short, params, use_tqdm=False)
    llm = make_llm(q8_gguf, **kw)
    together = llm.generate(short + long, params, use_tqdm=False)[:3]
    # mixed steps ran: the 3 decoding rows with the long prompt's chunk (the first step has the 3 prompts alone)
    assert any(d.is_prefill and d.batch_size == 4 and d.num_tokens > 4 for d in llm.engine.recorder.devices)
    for a, b in zip(alone, together):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@native
def test_bf16_prefill_logprobs_close_to_the_int8_path(q8_gguf, make_llm):
    """Teacher-forced over a long prompt: the bf16 chunk's distributions stay close to the int8 chunk's
    (the real model's gate, KL against the exact mode, is benchmarks/kl_divergence.py --prefill-acts)."""
    from tandem.bench.accuracy import divergence, teacher_forced_logprobs
    ids = _prompts(1, 300, 6)[0]
    runs = {}
    for act in ("int8", "bf16"):
        llm = make_llm(q8_gguf, device_backend="inline", prefill_act=act, batch_invariant=False, prefix_cache=False)
        runs[act] = teacher_forced_logprobs(llm, ids)
    exact = teacher_forced_logprobs(make_llm(q8_gguf, device_backend="inline", kernels_act="fp32",
                                             prefix_cache=False), ids)
    assert not runs["bf16"].equal(runs["int8"])
    d16, d8 = divergence(exact, runs["bf16"]), divergence(exact, runs["int8"])
    assert 0 < d16.kl_mean < 1e-3 and d16.top1_agree > 0.9
    assert d16.kl_mean < 3 * d8.kl_mean + 1e-5


@native
def test_cascade_under_bf16_prefill(q8_gguf, make_llm, monkeypatch):
    """Rows extending one cached prefix in a long chunk attend it by the cascade in bf16 where the bf16 SDPA
    runs (CPUs with AMX tiles; elsewhere the native extend op, which reads the prefix in place, and no cascade):
    the first tokens' distributions stay close to the same chunk without the cascade (one bf16 SDPA over the
    padded layout)."""
    import tandem.model.attention_paths as llama_mod
    calls = []
    real = llama_mod.cascade_attention
    monkeypatch.setattr(llama_mod, "cascade_attention", lambda q, *a: calls.append(q.dtype) or real(q, *a))
    prefix = _prompts(1, 150, 7)[0]
    prompts = [prefix + p for p in _prompts(5, 30, 8)]
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    got = {}
    for on in (True, False):
        llm = make_llm(q8_gguf, device_backend="inline", prefill_act="bf16", batch_invariant=False,
                       shared_prefix_attention=on)
        llm.generate([prefix + [9]], one, use_tqdm=False)                 # the prefix, cached
        got[on] = [o.outputs[0].logprobs[0] for o in llm.generate(prompts, one, use_tqdm=False)]
        sdpa = not llm.engine.executor.model_runner.model.extend_native
    if sdpa:
        assert calls and set(calls) == {torch.bfloat16}                  # the cascade ran, in bf16
    else:
        assert not calls
    for a, b in zip(got[True], got[False]):
        common = set(a) & set(b)
        assert len(common) >= 4
        assert max(abs(a[t] - b[t]) for t in common) < 0.05


@native
def test_bf16_prefill_keeps_an_fp32_cache_fp32(q8_gguf, make_llm):
    """K/V are written from fp32 and rounded once by the cache: an fp32 cache under bf16 chunks holds fp32
    values (not bf16-rounded ones), while the chunk's attention reads them in bf16."""
    llm = make_llm(q8_gguf, device_backend="inline", prefill_act="bf16", batch_invariant=False,
                   kv_cache_dtype="float32", prefix_cache=False)
    data = llm.engine.executor.model_runner.kv_cache.data
    assert data.dtype == torch.float32
    data.zero_()                                       # then only the prefill's K/V are non-zero
    llm.generate(_prompts(1, 200, 9), SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    used = data[data != 0]
    assert used.numel() >= 200 * data[0].numel() // 2 and not used.equal(used.bfloat16().float())


@native
def test_bf16_prefill_on_sliding_window_layers(tmp_path, make_llm):
    """Gemma 3 (sliding-window layers, sandwich norms, GeGLU, head_dim 256) under bf16 chunks: the window masks
    apply to the bf16 SDPA (or the extend op's window, without AMX), and the distributions stay close to the int8 chunk's."""
    from tandem.bench.accuracy import divergence, teacher_forced_logprobs
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    gguf = str(write_tiny_gguf(tmp_path / "g3.gguf", make_tiny_model(tmp_path / "g3", "gemma3"), quant="Q8_0"))
    ids = _prompts(1, 200, 10)[0]
    runs = {}
    for act in ("int8", "bf16"):
        llm = make_llm(gguf, device_backend="inline", prefill_act=act, batch_invariant=False,
                       prefix_cache=False)
        assert llm.engine.executor.model_runner.model.prefill_bf16 == (act == "bf16")
        assert any(layer["window"] for layer in llm.engine.executor.model_runner.model.layers)
        runs[act] = teacher_forced_logprobs(llm, ids)
    d = divergence(runs["int8"], runs["bf16"])
    assert not runs["bf16"].equal(runs["int8"]) and d.kl_mean < 1e-3 and d.top1_agree > 0.9
