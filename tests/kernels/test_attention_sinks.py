"""Attention sinks (gpt-oss: a learned logit per query head joining every query's softmax as a key with no value)
in every attention op and path. Checked: each native op against the torch reference on every ISA body, fp32 /
bf16 / q8_0 caches, GQA, windows 0 and > 0 (the sink stays), rows split into chunks; the reference itself against
transformers' formula in its log-sum-exp form; the causal op still gives every token its decode row's bits, with
fp32 and bf16 products; a sink of -inf gives the sink-free bits and sinks=None the op as without the argument;
and the Attention entry point's paths (batch_invariant on and off, the token path, a mixed step, the torch SDPA
path and the cascade) against the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.kernels.attention import (decode_attention_qkv_, decode_attention_qkv_ref, extend_attention_ref,
                                      sink_attention)
from tests.helpers.isa import isas
from tests.kernels.test_extend_attention import _case

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
H, KVH, D, SCALE = 6, 2, 32, 0.125
NEW, CACHED = [5, 3, 1, 9], [0, 300, 7, 40]          # a fresh row, a split one (> 256 keys), a decode row
tandem = torch.ops.tandem if kernels.available() else None


def _sinks(seed=1, h=H):
    """Logits on the scores' scale and above it, so the sink takes a visible share of some heads' softmax."""
    return (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2 + 1).float()


def _inputs(dtype, seed=0):
    q, cache, kv_index, tok_row, pos = _case(NEW, CACHED, H, KVH, D, torch.float32, seed=seed)
    if dtype == "q8_0":
        from tandem.kernels.kv_quant import quantize
        cache = quantize(cache)
    else:
        cache = cache.to(dtype)
    return q, cache, kv_index, tok_row, pos


def _decode_rows(q, cache, kv_index, tok_row, pos, window, isa, sinks, bf16=False):
    """Each token alone, a decode row of the decode op."""
    return torch.cat([tandem.decode_attention(q[t:t + 1], cache, 1, kv_index[tok_row[t:t + 1]], pos[t:t + 1] + 1,
                                              SCALE, isa, -1, window, bf16, sinks).reshape(1, -1)
                      for t in range(q.shape[0])])


def test_reference_is_the_lse_form():
    """sink_attention (transformers' explicit softmax with the sink column) equals SDPA's output times
    sigmoid(lse - sink), and a sink of -inf gives SDPA's output."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, 4, D, generator=g)
    k, v = torch.randn(2, KVH, 7, D, generator=g), torch.randn(2, KVH, 7, D, generator=g)
    mask = torch.rand(2, 1, 4, 7, generator=g) < 0.7
    mask[..., 0] = True
    s = _sinks()
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), 0.0, False,
        attn_mask=torch.zeros(mask.shape).masked_fill(~mask, float("-inf")), scale=SCALE)
    want = o * torch.sigmoid(lse - s[None, :, None])[..., None]
    torch.testing.assert_close(sink_attention(q, k, v, mask, SCALE, s), want, rtol=1e-5, atol=1e-6)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(sink_attention(q, k, v, mask, SCALE, torch.full((H,), float("-inf"))), plain,
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want, plain, atol=1e-3)                 # the sinks matter at these logits


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "q8_0"])
@pytest.mark.parametrize("window", [0, 37])
def test_ops_match_reference_and_causal_is_decode_bits(isa, dtype, window):
    """decode, causal and extend with sinks within fp32 rounding of the reference (q8_0: the reference reads the
    blocks widened, exactly), and the causal op's tokens exactly their decode rows' bits."""
    q, cache, kv_index, tok_row, pos = _inputs(dtype)
    s = _sinks()
    want = extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, SCALE, window, s)
    causal = tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, SCALE, window, isa, False, s)
    decode = _decode_rows(q, cache, kv_index, tok_row, pos, window, isa, s)
    extend = tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, SCALE, window, isa, False, s)
    assert torch.equal(causal, decode)
    for got in (causal, extend):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    batch = tandem.decode_attention(q, cache, 1, kv_index[tok_row], pos + 1, SCALE, isa, -1, window, False, s)
    assert torch.equal(batch.reshape(q.shape[0], -1), decode)        # rows in one call: the same bits


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("bf16", [False, True])
def test_causal_is_decode_bits_with_products(isa, bf16):
    """A long prompt's chunk (rows split into several chunks) on a bf16 cache, with fp32 or bf16 products (where
    the body takes them): with sinks every token still gets its decode row's bits, close to the reference."""
    q, cache, kv_index, tok_row, pos = _case([12, 4], [700, 3], 8, 2, 64, torch.bfloat16, seed=4)
    s = _sinks(2, 8)
    got = tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, SCALE, 0, isa, bf16, s)
    assert torch.equal(got, _decode_rows(q, cache, kv_index, tok_row, pos, 0, isa, s, bf16))
    tol = 2e-2 if bf16 else 2e-5
    torch.testing.assert_close(got, extend_attention_ref(q, cache, 1, kv_index, tok_row, pos, SCALE, 0, s),
                               rtol=tol, atol=tol)
    ext = tandem.extend_attention(q, cache, 1, kv_index, tok_row, pos, SCALE, 0, isa, bf16, s)
    torch.testing.assert_close(ext, got, rtol=tol, atol=tol)


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("window", [0, 37])
def test_minus_inf_sinks_and_none_change_no_bit(isa, window):
    """A sink of -inf adds exp(-inf) = 0 to the sum and rescales nothing: every op gives its sink-free bits; and
    sinks=None is the op without the argument."""
    q, cache, kv_index, tok_row, pos = _inputs(torch.bfloat16)
    off = torch.full((H,), float("-inf"))
    for op in (tandem.causal_attention, tandem.extend_attention):
        plain = op(q, cache, 1, kv_index, tok_row, pos, SCALE, window, isa, False)
        assert torch.equal(op(q, cache, 1, kv_index, tok_row, pos, SCALE, window, isa, False, off), plain)
        assert torch.equal(op(q, cache, 1, kv_index, tok_row, pos, SCALE, window, isa, False, None), plain)
    rows, lens = kv_index[tok_row], pos + 1
    plain = tandem.decode_attention(q, cache, 1, rows, lens, SCALE, isa, -1, window)
    assert torch.equal(tandem.decode_attention(q, cache, 1, rows, lens, SCALE, isa, -1, window, False, off), plain)
    assert torch.equal(tandem.decode_attention(q, cache, 1, rows, lens, SCALE, isa, -1, window, False, None), plain)


@native
@pytest.mark.parametrize("dtype", [torch.float32, "q8_0"])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_qkv_matches_reference(dtype, window):
    """The fused decode step (K/V written, then attended) with sinks against its reference; GQA, a split row."""
    g = torch.Generator().manual_seed(3)
    b, lk = 3, 400
    cache = torch.randn(b * lk + 2, 2, 2, KVH, D, generator=g)
    if dtype == "q8_0":
        from tandem.kernels.kv_quant import quantize
        cache = quantize(cache)
    kv_index = torch.randperm(b * lk + 1, generator=g)[:b * lk].view(b, lk)
    lens = torch.tensor([400, 9, 130])
    loc = kv_index[torch.arange(b), lens - 1]
    qkv = torch.randn(b, (H + 2 * KVH) * D, generator=g)
    s = _sinks(5)
    ref_cache = cache.clone()
    got = decode_attention_qkv_(qkv, cache, 1, loc, kv_index, lens, SCALE, H, window, sinks=s)
    want = decode_attention_qkv_ref(qkv, ref_cache, 1, loc, kv_index, lens, SCALE, H, window, s)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(cache, ref_cache)


@native
@pytest.mark.parametrize("isa", isas())
def test_shared_prefix_tasks_keep_the_bits(isa):
    """Decode rows on shared prefixes (csrc/shared_prefix_attention.cpp: several rows a task) with sinks: the same
    bits with sharing on and off and for a row alone, close to the reference. (Global rows: a local row whose
    window has left position 0 never shares.)"""
    window = 0
    from tests.kernels.test_cascade_attention import BATCHES, shared_batch
    cache, kv_index, lens = shared_batch(BATCHES["branching"], kvh=KVH, d=D, dtype=torch.bfloat16, seed=2)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(1)) * 3
    s = _sinks(3)

    def run(share, rows=slice(None)):
        old = tandem.shared_prefix_attention(int(share))
        try:
            return tandem.decode_attention(q[rows], cache, 1, kv_index[rows], lens[rows], SCALE, isa, -1, window,
                                           False, s)
        finally:
            tandem.shared_prefix_attention(old)
    before = tandem.shared_prefix_attention(-2)
    on = run(True)
    assert tandem.shared_prefix_attention(-2) > before, "no chunk was shared"
    assert torch.equal(on, run(False))
    assert torch.equal(on[1:2], run(True, slice(1, 2)))
    want = extend_attention_ref(q, cache, 1, kv_index, torch.arange(len(lens)), lens - 1, SCALE, window, s)
    torch.testing.assert_close(on.reshape(len(lens), -1), want, rtol=2e-5, atol=2e-5)


@native
def test_bad_sinks_are_refused():
    q, cache, kv_index, tok_row, pos = _inputs(torch.float32)
    for bad in (torch.zeros(H + 1), torch.zeros(H, dtype=torch.float64), torch.zeros(2 * H)[::2]):
        with pytest.raises(RuntimeError, match="sinks"):
            tandem.causal_attention(q, cache, 1, kv_index, tok_row, pos, SCALE, 0, -1, False, bad)


# The Attention entry point (model/attention_paths.py): a step laid out as the runner lays it out
# (device/attention_layout.py), every path with layer 0's sinks against the reference.
PATHS = {   # name: (native, batch_invariant, cascade, extend_lens, seq_lens, the ops it takes)
    "causal": (True, True, False, [12, 5], [12, 40], {"causal_attention"}),
    "token": (True, False, False, [3, 1], [3, 40], {"decode_attention_qkv_"}),
    "extend": (True, False, False, [12, 5], [12, 40], {"extend_attention"}),
    "mixed": (True, True, False, [1, 1, 9], [30, 7, 20], {"decode_attention_qkv_", "causal_attention"}),
    "mixed_extend": (True, False, False, [1, 1, 9], [30, 7, 20], {"decode_attention_qkv_", "extend_attention"}),
    "sdpa": (False, False, False, [12, 5], [12, 40], {"sdpa_sinks"}),
    "sdpa_fresh": (False, False, False, [6, 4], [6, 4], {"sdpa_sinks"}),
    "sdpa_mixed": (False, False, False, [1, 1, 9], [30, 7, 20], {"sdpa_sinks"}),
    "cascade": (False, False, True, [4, 3], [80, 75], {"cascade_attention"}),
}
SHARED = 70          # the cascade's rows share their first 70 slots


class _Model:
    def __init__(self, attention):
        self.native, self.attention = attention.native, attention


def _step(ext, seq, attention, cascade, seed=0):
    """A step's layout (meta), its q, k, v, its cache and each row's slots, on rows ext new of seq keys."""
    from tandem.device.attention_layout import AttentionLayouts
    from tandem.device.step_layout import row_groups, token_layout
    from tandem.model.kv_cache import AttentionMeta, PagedKVCache
    g = torch.Generator().manual_seed(seed)
    ext, seq = np.array(ext), np.array(seq)
    b, lk = len(ext), int(seq.max())
    cache = PagedKVCache(b * lk + SHARED, 1, KVH, D, torch.bfloat16, torch.device("cpu"))
    cache.data[:-1] = torch.randn(cache.data[:-1].shape, generator=g).bfloat16()
    slots = torch.randperm(b * lk + SHARED, generator=g)
    req_to_token = slots[SHARED:].view(b, lk).clone()
    if cascade:
        req_to_token[:, :SHARED] = slots[:SHARED]
    lay = token_layout(ext, seq)
    positions = torch.from_numpy(lay.positions).long()
    loc = req_to_token[torch.from_numpy(lay.tok_row).long(), positions]
    layouts = AttentionLayouts(torch.device("cpu"), req_to_token, cache, _Model(attention), cascade)
    nd, groups = row_groups(ext, seq)
    if len(groups) == 1:
        meta = layouts._group(seq, ext, torch.arange(b), positions, loc, torch.from_numpy(lay.last), lay)
    else:
        parts = []
        for part, (lo, hi) in enumerate(groups):
            t0, t1 = (lo, hi) if hi <= nd else (nd, len(positions))
            m = layouts._group(seq[lo:hi], ext[lo:hi], torch.arange(lo, hi), positions[t0:t1], loc[t0:t1], None,
                               token_layout(ext[lo:hi], seq[lo:hi]), part=part)
            parts.append((slice(t0, t1), m))
        meta = AttentionMeta(None, None, None, None, torch.from_numpy(lay.last), parts)
    t = len(positions)
    q, k, v = (torch.randn(t, n, D, generator=g) for n in (H, KVH, KVH))
    return meta, (q, k, v), cache, req_to_token, torch.from_numpy(lay.tok_row).long(), positions


@native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [0, 5])
def test_attention_paths_take_the_sinks(path, window, monkeypatch):
    """Every path of a step's tokens with sinks within fp32 rounding of the reference; the paths of the
    batch-invariance rule (the causal op, the token path, decode rows) exactly the decode op's bits per token."""
    from tandem.model import attention_paths
    from tandem.model.attention_paths import Attention
    from tandem.model.numerics import Numerics
    native, bi, cascade, ext, seq, ops = PATHS[path]
    if cascade and window:
        pytest.skip("the runner never takes the cascade with sliding windows (device/attention_layout.py)")
    monkeypatch.setattr(attention_paths, "small_m", lambda: 4)        # tiny chunks reach the extend op
    ran = set()
    for name in ("causal_attention", "extend_attention", "decode_attention_qkv_", "sdpa_sinks", "cascade_attention"):
        op = getattr(attention_paths, name)
        monkeypatch.setattr(attention_paths, name, lambda *a, _op=op, _name=name, **kw: ran.add(_name) or _op(*a, **kw))
    attention = Attention(Numerics(native=native, batch_invariant=bi, kv_dtype=torch.bfloat16), SCALE, H, [window],
                          [_sinks(7).bfloat16()])                       # a checkpoint's bf16 parameter
    meta, (q, k, v), cache, req_to_token, tok_row, pos = _step(ext, seq, attention, cascade)
    if cascade:
        assert meta.shared is not None
    got = attention(0, q, k, v, meta)
    assert ran == ops
    s = _sinks(7).bfloat16().float()
    want = extend_attention_ref(q, cache.data, 0, req_to_token, tok_row, pos, SCALE, window, s)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    if native and (bi or path == "token"):
        rows = [tandem.decode_attention(q[i:i + 1], cache.data, 0, req_to_token[tok_row[i:i + 1]], pos[i:i + 1] + 1,
                                        SCALE, -1, -1, window, False, s) for i in range(len(pos))]
        assert torch.equal(got, torch.cat(rows).reshape(len(pos), -1))
    plain = Attention(Numerics(native=native, batch_invariant=bi, kv_dtype=torch.bfloat16), SCALE, H, [window])
    meta, (q, k, v), cache, req_to_token, tok_row, pos = _step(ext, seq, plain, cascade)
    torch.testing.assert_close(plain(0, q, k, v, meta),
                               extend_attention_ref(q, cache.data, 0, req_to_token, tok_row, pos, SCALE, window))
