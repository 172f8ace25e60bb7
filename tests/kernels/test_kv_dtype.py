"""The KV cache's element type (kv_cache_dtype): bf16 and fp16 caches in the native decode attention against the
torch reference that widens the same cache, the native K/V write rounding exactly as torch's conversion (so a
slot holds the same bits whichever path wrote it), the "auto" choice (bf16 where the linears round x to int8,
the model dtype in the exact mode and for unquantized weights), and the engine end to end on a bf16 cache."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels import kv_quant
from tandem.kernels.attention import decode_attention_qkv_ref, decode_attention_ref
from tests.helpers.isa import isas

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
LOW = [torch.bfloat16, torch.float16]
CASES = [  # batch, query heads, KV heads, head_dim, keys per row, window
    (1, 9, 3, 64, [2048], 0),
    (4, 12, 4, 128, [5, 1, 300, 33], 0),
    (3, 6, 2, 24, [7, 130, 64], 0),            # SIMD tails
    (3, 4, 1, 256, [1, 700, 513], 512),        # Gemma 3's local layers
]


def inputs(b, h, kvh, d, lens, dtype, seed):
    """A 2-layer cache of `dtype` (kv_quant.Q8_0: q8_0 blocks) with each row's keys in scattered slots, padded past
    its length, and each row's new token in a slot of its own."""
    g = torch.Generator().manual_seed(seed)
    lk = max(lens)
    slots = lk + 16 + b
    cache = torch.randn(slots + 1, 2, 2, kvh, d, generator=g)
    cache = kv_quant.quantize(cache * 2) if dtype == kv_quant.Q8_0 else cache.to(dtype)
    cache[-1] = 0
    kv_index = torch.stack([torch.randperm(slots - b, generator=g)[:lk] for _ in range(b)])
    seq_lens = torch.tensor(lens)
    kv_index[torch.arange(lk)[None, :] >= seq_lens[:, None]] = slots
    loc = slots - b + torch.arange(b)                  # each row's new token: a slot of its own
    kv_index[torch.arange(b), seq_lens - 1] = loc
    return cache, kv_index, seq_lens, loc


@native
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("b, h, kvh, d, lens, window", CASES)
def test_low_precision_cache_equals_reference(dtype, isa, b, h, kvh, d, lens, window):
    """Both ops on a bf16 / fp16 cache: the output equals SDPA over the same rounded keys widened to fp32 (the op
    sums in fp32), and the fused op's K/V write leaves the very bits torch's index_put writes."""
    check_decode_ops(b, h, kvh, d, lens, dtype, window, isa, atol=1e-5)


def check_decode_ops(b, h, kvh, d, lens, dtype, window, isa, atol):
    """decode_attention (unsplit, forced and chosen chunks) and decode_attention_qkv_ against their references on
    a cache of `dtype`; the fused op's write leaves the reference's bytes."""
    cache, kv_index, seq_lens, loc = inputs(b, h, kvh, d, lens, dtype, seed=d + h + len(lens))
    g = torch.Generator().manual_seed(b)
    q = torch.randn(b, h, d, generator=g) * 3
    for layer in (0, 1):
        ref = decode_attention_ref(q, cache, layer, kv_index, seq_lens, d ** -0.5, window)
        for chunk_keys in (0, 32, -1):
            got = torch.ops.tandem.decode_attention(q, cache, layer, kv_index, seq_lens, d ** -0.5, isa, chunk_keys,
                                                    window)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=atol)
    qkv = torch.randn(b, (h + 2 * kvh) * d, generator=g) * 2
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = decode_attention_qkv_ref(qkv, ref_cache, 1, loc, kv_index, seq_lens, 0.1, h, window)
    got = torch.ops.tandem.decode_attention_qkv_(qkv, got_cache, 1, loc, kv_index, seq_lens, 0.1, h, isa, -1, window)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=atol)
    assert torch.equal(got_cache.view(torch.uint8), ref_cache.view(torch.uint8))


@native
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_native_write_rounds_as_torch(dtype):
    """Ties, values that round up to the next binade, the largest finite value, overflow to inf, subnormals,
    signed zeros, inf and NaN: the op's fp32 -> bf16 / fp16 rounding is torch's, bit for bit (NaN: a NaN)."""
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, 1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11,
                            info.max, -info.max, 7e4, -1e38, 3.0e38, info.tiny, info.tiny / 3, 1e-40, -1e-45,
                            float("inf"), float("-inf"), float("nan")])
    g = torch.Generator().manual_seed(3)
    values = torch.cat([special, torch.randn(1024 - special.numel(), generator=g) * 10 ** torch.randint(
        -8, 8, (1024 - special.numel(),), generator=g).float()])
    kvh, d, h = 2, 64, 2
    qkv = torch.cat([torch.zeros(4, h * d), values.view(4, 2 * kvh * d)], dim=1)
    qkv[:, :h * d] = 0.01                           # finite queries: only the write is under test
    cache = torch.zeros(9, 1, 2, kvh, d, dtype=dtype)
    loc, seq_lens = torch.tensor([1, 3, 5, 7]), torch.ones(4, dtype=torch.long)
    kv_index = loc[:, None]
    got = cache.clone()
    torch.ops.tandem.decode_attention_qkv_(qkv, got, 0, loc, kv_index, seq_lens, 0.1, h)
    ref = cache.clone()
    ref[loc, 0, 0] = qkv[:, h * d:(h + kvh) * d].reshape(4, kvh, d).to(dtype)
    ref[loc, 0, 1] = qkv[:, (h + kvh) * d:].reshape(4, kvh, d).to(dtype)
    nan = ref.isnan()                # NaN stays NaN (torch's vector path writes 0xffff for it, c10's 0x7fc0)
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def test_kv_cache_dtype_is_validated():
    from tandem.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig().kv_cache_dtype == "auto"


@native
def test_auto_is_bf16_only_where_the_linears_round(tiny_llama, tmp_path, make_llm):
    """A quantized GGUF in the default mode gets a bf16 cache; the same file in the exact mode, or unquantized
    weights, keep fp32 (the parity tests' mode); an explicit choice wins."""
    from tests.helpers.tiny_models import write_tiny_gguf
    gguf = str(write_tiny_gguf(tmp_path / "q8.gguf", tiny_llama, quant="Q8_0"))
    cases = [(gguf, {}, "bfloat16"), (gguf, {"kernels_act": "fp32"}, "float32"), (tiny_llama, {}, "float32"),
             (gguf, {"kv_cache_dtype": "float16"}, "float16"), (gguf, {"kv_cache_dtype": "float32"}, "float32")]
    for model, kw, want in cases:
        llm = make_llm(model, device_backend="inline", **kw)
        assert str(llm.engine.executor.model_runner.kv_cache.data.dtype).removeprefix("torch.") == want, (model, kw)


@native
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_on_a_low_precision_cache(tiny_llama, tmp_path, make_llm, dtype):
    """End to end on a bf16 / fp16 cache: both loops give the same tokens, a prefix-cache hit gives what a fresh
    prefill gave, and the first token's logprobs stay close to the fp32 cache's (the rounding is small)."""
    from tests.helpers.tiny_models import write_tiny_gguf
    gguf = str(write_tiny_gguf(tmp_path / "q8.gguf", tiny_llama, quant="Q8_0"))
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 101, 7 + i] * (1 + i) for i in range(6)]
    check_engine_on_cache(make_llm, gguf, dtype, prompts, 0.05)


def check_engine_on_cache(make_llm, gguf: str, dtype: str, prompts: list[list[int]], tol: float,
                          paths: tuple[dict, ...] = ({},)) -> None:
    """On a `dtype` KV cache: the serial and overlap loops give the same greedy and seeded tokens, and so does a
    third run served by the prefix cache; the first token's logprob stays within `tol` of the fp32 cache's on
    every engine of `paths` (extra engine options each)."""
    from tandem import SamplingParams
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    # prefill_act int8: the fresh prefill (126 tokens, one long chunk) and the cache hits (the last token of each)
    # then run the same linears; under bf16 long chunks they differ by design (tests/kernels/test_prefill_bf16.py), as
    # under the extend op's bf16 products (prefill_attention, tests/kernels/test_extend_attention.py): fp32 here.
    llm = make_llm(gguf, kv_cache_dtype=dtype, prefill_act="int8", prefill_attention="fp32")
    runs = []
    for scheduler in ("serial", "overlap", "overlap"):          # the third run is served by the prefix cache
        llm.engine.config = llm.engine.config.replace(scheduler=scheduler)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, [greedy, seeded] * 3, use_tqdm=False)])
    assert runs[0] == runs[1] == runs[2]
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    exact = make_llm(gguf, kv_cache_dtype="float32", prefix_cache=False).generate(prompts, one, use_tqdm=False)
    for kw in paths:
        low = make_llm(gguf, kv_cache_dtype=dtype, prefix_cache=False, **kw).generate(prompts, one, use_tqdm=False)
        for x, y in zip(exact, low):
            tok = x.outputs[0].token_ids[0]
            lx, ly = x.outputs[0].logprobs[0][tok], y.outputs[0].logprobs[0].get(tok)
            assert ly is not None and abs(lx - ly) < tol, (kw, lx, ly)
