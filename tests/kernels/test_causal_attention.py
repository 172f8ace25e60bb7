"""The causal attention of prompt tokens (csrc/causal_attention.cpp): every token gets, bit for bit, what the
decode op gives it as a decode row over its own causal keys, however the prompt is cut into chunks and
whatever else the call holds (the batch-invariance rule of tandem/model/attention_paths.py). Checked on every
ISA body, every KV cache dtype, GQA and head sizes of the supported models, sliding windows, long contexts
(split rows), thread counts, and against the torch reference within fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels.attention import extend_attention_ref
from tests.helpers.isa import isas
from tests.kernels.test_extend_attention import _case

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, "q8_0"]


def _cache(cache, dtype):
    if dtype != "q8_0":
        return cache
    from tandem.kernels.kv_quant import quantize
    return quantize(cache.float())


def _as_decode_rows(q, cache, kv_index, tok_row, pos, window, isa, bf16=False):
    """Each token alone, a decode row of the decode op."""
    return torch.cat([torch.ops.tandem.decode_attention(q[t:t + 1], cache, 1, kv_index[tok_row[t:t + 1]],
                                                        pos[t:t + 1] + 1, 0.125, isa, -1, window, bf16)
                      .reshape(1, -1) for t in range(q.shape[0])])


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 1, 256), (14, 2, 128), (8, 8, 32), (3, 3, 20), (4, 1, 512)])
@pytest.mark.parametrize("window", [0, 37])
def test_each_token_is_its_decode_row(isa, dtype, h, kvh, d, window):
    if dtype == "q8_0" and d % 32:
        pytest.skip("q8_0 blocks need head_dim % 32 == 0")
    q, cache, kv_index, tok_row, pos = _case([5, 70, 1, 130, 9], [0, 100, 7, 3, 290], h, kvh, d,
                                             torch.float32 if dtype == "q8_0" else dtype)
    cache = _cache(cache, dtype)
    got = torch.ops.tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, window, isa)
    assert torch.equal(got, _as_decode_rows(q, cache, kv_index, tok_row, pos, window, isa))
    if dtype != "q8_0":
        want = extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, 0.125, window)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("cut", [[1] * 11, [3, 8], [7, 4], [11]])
@pytest.mark.parametrize("bf16", [False, True])
def test_chunking_and_batch_mates_change_no_bit(isa, cut, bf16):
    """One prompt of 11 tokens on 4,200 cached keys (rows split into chunks, past 4,096 keys where the chunk size
    grows), prefilled in pieces, each piece beside another request's tokens: the same bits as in one call, and
    each token its decode row; with fp32 and with bf16 products (the latter where the body takes them)."""
    q, cache, kv_index, tok_row, pos = _case([11, 50], [4200, 10], 9, 3, 64, torch.bfloat16, seed=3)
    whole = torch.ops.tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, 0, isa, bf16)
    t0, pieces = 0, []
    for n in cut:
        sel = torch.cat([torch.arange(t0, t0 + n), torch.arange(11, 11 + 5 * len(cut))[:5]])
        out = torch.ops.tandem.causal_attention(q[sel], cache, 1, kv_index, tok_row[sel], pos[sel], 0.125, 0, isa,
                                                bf16)
        pieces.append(out[:n])
        t0 += n
    assert torch.equal(torch.cat(pieces), whole[:11])
    sel = torch.tensor([0, 5, 10, 11, 60])
    assert torch.equal(whole[sel], _as_decode_rows(q[sel], cache, kv_index, tok_row[sel], pos[sel], 0, isa, bf16))


@native
@pytest.mark.parametrize("bf16", [False, True])
def test_thread_count_and_slices_change_no_bit(bf16):
    """Two threads or one; and a chunk long enough to be cut into several slices of partials; fp32 and bf16
    products."""
    q, cache, kv_index, tok_row, pos = _case([1200, 40], [3000, 0], 4, 2, 32, torch.bfloat16, seed=4)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.ops.tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, 0, -1, bf16))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    sel = torch.tensor([0, 600, 1199, 1200, 1239])
    assert torch.equal(outs[0][sel], _as_decode_rows(q[sel], cache, kv_index, tok_row[sel], pos[sel], 0, -1, bf16))


@native
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 1, 256), (14, 2, 128), (8, 8, 32), (8, 2, 64), (4, 1, 512)])
@pytest.mark.parametrize("window", [0, 37])
def test_bf16_products_are_the_decode_ops(h, kvh, d, window):
    """bf16 products (where the CPU has AVX512-BF16: the decode task's bf16 body for the prompt's tokens; elsewhere
    the fp32 body on both sides): each token its decode row, bit for bit, within bf16's rounding of the
    reference."""
    q, cache, kv_index, tok_row, pos = _case([40, 3, 70, 1], [300, 0, 33, 130], h, kvh, d, torch.bfloat16, seed=5)
    got = torch.ops.tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, 0.125, window, -1, True)
    assert torch.equal(got, _as_decode_rows(q, cache, kv_index, tok_row, pos, window, -1, True))
    want = extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, 0.125, window)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)


@native
def test_bad_arguments_are_clear_errors():
    q, cache, kv_index, tok_row, pos = _case([4, 3], [2, 0], 4, 2, 16, torch.float32)
    op = torch.ops.tandem.causal_attention
    bad = [
        ((q.double(), cache, 1, kv_index, tok_row, pos, 0.1), "fp32"),
        ((q, cache, 1, kv_index, tok_row[:3], pos, 0.1), "tok_row"),
        ((q, cache, 1, kv_index, tok_row + 5, pos, 0.1), "tok_row"),
        ((q, cache, 1, kv_index, tok_row, pos + 100, 0.1), "positions"),
        ((q, cache, 1, kv_index.clone().fill_(10 ** 6), tok_row, pos, 0.1), "kv_index"),
        ((q, cache, 9, kv_index, tok_row, pos, 0.1), "layer"),
        ((q, cache, 1, kv_index, tok_row, pos, 0.1, -1), "window"),
    ]
    for args, word in bad:
        with pytest.raises(RuntimeError, match=word):
            op(*args)
