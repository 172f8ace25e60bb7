"""The q8_0 KV cache (kv_cache_dtype="q8_0"): its torch format (kernels/kv_quant.py) against llama.cpp's block_q8_0
as the gguf package writes it, the native K/V write giving the torch quantizer's bytes exactly, and the decode,
fused decode and extend ops reading q8_0 blocks in place against their torch references (which dequantize the
same cache) on every ISA body, with windows, forced chunks and GQA; a row's output the same bits in any batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem import kernels
from tandem.kernels import kv_quant
from tandem.kernels.attention import decode_attention_qkv_ref, extend_attention_ref
from tests.helpers.isa import isas
from tests.kernels.test_kv_dtype import check_decode_ops, check_engine_on_cache

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")


def q8_cache(slots, kvh, d, g, layers=2):
    """A q8_0 cache [slots + 1, layers, 2, KVH, D / 32 * 34] of random rows, the last (pad) slot zero."""
    cache = kv_quant.quantize(torch.randn(slots + 1, layers, 2, kvh, d, generator=g) * 2)
    cache[-1] = 0
    return cache


def test_format_is_llama_cpp_block_q8_0():
    """A row is D / 32 blocks of (fp16 scale, 32 int8), the bytes the gguf package's Q8_0 quantizer writes where
    no value lies on a rounding tie; dequantized within half a step of the input (and d's fp16 rounding); zero blocks stay zero."""
    gguf = pytest.importorskip("gguf")
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0)) * 3
    x[2, 32:64] = 0
    got = kv_quant.quantize(x)
    assert got.dtype == torch.uint8 and got.shape == (7, 4 * 34)
    want = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.numpy(), want)
    back = kv_quant.dequantize(got)
    step = x.view(7, 4, 32).abs().amax(-1, keepdim=True) / 127
    assert ((back - x).view(7, 4, 32).abs() <= step * (0.5 + 127 * 2 ** -11)).all()    # d is rounded to fp16
    assert torch.equal(back[2, 32:64], torch.zeros(32))
    assert kv_quant.head_dim(got) == 128
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_quant.quantize(torch.zeros(2, 48))


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("b, h, kvh, d, lens, window", [
    (1, 9, 3, 64, [2048], 0),
    (4, 12, 4, 128, [5, 1, 300, 33], 0),
    (5, 8, 2, 64, [31, 32, 33, 1000, 2], 0),
    (3, 4, 1, 256, [1, 700, 513], 512),
])
def test_decode_ops_equal_reference(isa, b, h, kvh, d, lens, window):
    """decode_attention and decode_attention_qkv_ on a q8_0 cache: the reference's output (SDPA over the
    dequantized keys, fp32) up to summation order, and the fused op's write leaves the torch quantizer's bytes."""
    check_decode_ops(b, h, kvh, d, lens, kv_quant.Q8_0, window, isa, atol=4e-5)


@native
def test_native_write_rounds_as_torch():
    """Ties of x / d (halves go to even), a zero block, tiny and huge magnitudes: the op's bytes are the torch
    quantizer's."""
    d = 64
    rows = torch.zeros(4, 3 * d)                           # one query head, one KV head: q, k, v of 64 each
    k = rows[:, d:2 * d]
    k[0, :32] = torch.arange(32) - 16.5                    # amax 16.5 -> x * 127 / 16.5: values near ties
    k[0, 32:] = torch.linspace(-1, 1, 32) * 127            # exact integers: q = x, d = 1
    k[1, :32] = 1e-30
    k[1, 32:] = torch.randn(32) * 1e30
    rows[2:, d:] = torch.randn(2, 2 * d) * 1e-3
    rows[:, 2 * d:] = torch.randn(4, d)
    cache = torch.zeros(5, 1, 2, 1, d // 32 * 34, dtype=torch.uint8)
    ref_cache, got_cache = cache.clone(), cache.clone()
    loc, kv_index, lens = torch.arange(4), torch.arange(4)[:, None], torch.ones(4, dtype=torch.long)
    decode_attention_qkv_ref(rows, ref_cache, 0, loc, kv_index, lens, 0.1, 1)
    torch.ops.tandem.decode_attention_qkv_(rows, got_cache, 0, loc, kv_index, lens, 0.1, 1)
    assert torch.equal(got_cache, ref_cache)


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("h,kvh,d,window", [(9, 3, 64, 0), (4, 1, 256, 37), (14, 2, 128, 0), (8, 8, 32, 0)])
def test_extend_equals_reference(isa, h, kvh, d, window):
    """Ragged rows (fresh, on cached keys, one token, longer than a key block) on a q8_0 cache."""
    g = torch.Generator().manual_seed(h * d)
    new, cached = [5, 70, 1, 130], [0, 100, 7, 3]
    b, lk = len(new), max(n + c for n, c in zip(new, cached))
    slots = b * lk + 3
    cache = q8_cache(slots, kvh, d, g)
    kv_index = torch.randperm(slots, generator=g)[:b * lk].view(b, lk)
    tok_row = torch.cat([torch.full((n,), r) for r, n in enumerate(new)])
    pos = torch.cat([torch.arange(c, c + n) for n, c in zip(new, cached)])
    q = torch.randn(len(tok_row), (h + 2 * kvh) * d, generator=g)[:, :h * d].view(-1, h, d)
    got = torch.ops.tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, window, isa)
    want = extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=4e-5)


@native
def test_a_row_is_the_same_in_any_batch():
    """A row's decode output on a q8_0 cache has the same bits alone, in a batch of 3 and of 37 (other lengths)."""
    g = torch.Generator().manual_seed(5)
    d, h, kvh, slots = 64, 8, 2, 3000
    cache = q8_cache(slots, kvh, d, g)
    lens = torch.randint(1, 2500, (37,), generator=g)
    lens[0] = 1700
    kv_index = torch.stack([torch.randperm(slots, generator=g)[:2500] for _ in range(37)])
    q = torch.randn(37, h, d, generator=g)
    outs = [torch.ops.tandem.decode_attention(q[:n], cache, 0, kv_index[:n], lens[:n], 0.125)[0] for n in (1, 3, 37)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@native
def test_bad_q8_cache_is_a_clear_error():
    cache = torch.zeros(5, 1, 2, 1, 40, dtype=torch.uint8)      # not D / 32 * 34 for D = 48
    q = torch.zeros(1, 1, 48)
    with pytest.raises(RuntimeError, match="head shapes"):
        torch.ops.tandem.decode_attention(q, cache, 0, torch.zeros(1, 1, dtype=torch.long), torch.ones(1,
                                          dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="q8_0"):
        torch.ops.tandem.extend_attention(q, cache, 0, torch.zeros(1, 1, dtype=torch.long),
                                          torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1.0)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory) -> str:
    """A tiny Q8_0 llama whose head_dim (32) q8_0 blocks can hold."""
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    hf = make_tiny_model(tmp_path_factory.mktemp("tiny-hd32"), "llama", head_dim=32)
    return str(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "q8.gguf", hf, quant="Q8_0"))


@native
def test_engine_on_a_q8_0_cache(q8_model, make_llm):
    """End to end: a slot takes 0.53x of bf16's bytes; both loops give the same tokens and a prefix-cache hit what
    a fresh prefill gave (the native ops and the torch writer quantize alike); the first token's logprobs stay
    close to the fp32 cache's; the torch path reads the same cache (dequantized) and agrees as closely."""
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 101, 7 + i] * (1 + 4 * i) for i in range(6)]
    inline = make_llm(q8_model, kv_cache_dtype="q8_0", device_backend="inline", kv_cache_tokens=100)
    data = inline.engine.executor.model_runner.kv_cache.data
    assert data.dtype == torch.uint8 and data.shape == (101, 2, 2, 2, 34)      # 34 bytes a head row, bf16's 64
    check_engine_on_cache(make_llm, q8_model, "q8_0", prompts, 0.1, paths=({}, {"kernels": "torch"}))


def test_q8_0_needs_head_dim_a_multiple_of_32(tiny_llama, make_llm):
    """tiny_llama's head_dim is 16: a clear error at load, not a wrong cache."""
    from tandem.config import EngineConfig
    assert EngineConfig(kv_cache_dtype="q8_0").kv_cache_dtype == "q8_0"
    with pytest.raises(Exception, match="multiple of 32"):
        make_llm(tiny_llama, kv_cache_dtype="q8_0", device_backend="inline")
