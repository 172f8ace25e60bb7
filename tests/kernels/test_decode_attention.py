"""The paged decode attention (csrc/decode_attention.cpp) against its torch reference (gather, then SDPA) on every
ISA body this CPU runs: ragged rows in one batch, contexts 1 to 4096, GQA ratios 1, 3 and 4, head_dim 64 and 128
(and an odd 24 for the SIMD tails), with the key range unsplit (chunk_keys=0), split into forced chunks and
split as the op picks (-1) at one and two threads; and a row's output bit for bit the same in any batch and at
any thread count (batch invariance)."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels.attention import decode_attention_ref
from tests.helpers.isa import isas

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: "
                                f"{kernels.unavailable_reason()}")

CASES = [  # batch, query heads, KV heads, head_dim, keys per row
    (1, 9, 3, 64, [1]),                        # SmolLM2-135M's heads, one key: 31 padded scores in the tile
    (1, 9, 3, 64, [2048]),
    (1, 8, 2, 128, [4096]),
    (4, 12, 4, 128, [5, 1, 300, 33]),          # ragged: rows of one chunk beside rows of several
    (5, 8, 2, 64, [31, 32, 33, 1000, 2]),      # GQA 4, tile edges
    (2, 4, 4, 64, [600, 513]),                 # GQA 1
    (3, 6, 2, 24, [7, 130, 64]),               # head_dim not a multiple of the SIMD width
    (1, 32, 4, 128, [200]),                    # Qwen3-30B-A3B's heads: one chunk, its KV heads split over threads
]


def inputs(b, h, kvh, d, lens, seed):
    """A cache of 2 layers whose rows' keys sit in scattered slots (shared between rows), padded past each length
    with the pad slot, and queries scaled so that the softmax is peaked and its maximum moves between tiles."""
    g = torch.Generator().manual_seed(seed)
    lk = max(lens)
    slots = lk + 16
    cache = torch.randn(slots + 1, 2, 2, kvh, d, generator=g)
    kv_index = torch.stack([torch.randperm(slots, generator=g)[:lk] for _ in range(b)])
    seq_lens = torch.tensor(lens)
    kv_index[torch.arange(lk)[None, :] >= seq_lens[:, None]] = slots
    q = torch.randn(b, h, d, generator=g) * 3
    return q, cache, kv_index, seq_lens


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("b, h, kvh, d, lens", CASES)
def test_decode_attention_equals_reference(isa, b, h, kvh, d, lens):
    q, cache, kv_index, seq_lens = inputs(b, h, kvh, d, lens, seed=len(lens) * d + h)
    threads = torch.get_num_threads()
    try:
        for layer in (0, 1):
            ref = decode_attention_ref(q, cache, layer, kv_index, seq_lens, d ** -0.5)
            for chunk_keys, nthreads in ((0, 2), (32, 2), (100, 1), (-1, 1), (-1, 2)):
                torch.set_num_threads(nthreads)
                got = torch.ops.tandem.decode_attention(q, cache, layer, kv_index, seq_lens, d ** -0.5, isa,
                                                        chunk_keys)
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"chunk_keys "
                                           f"{chunk_keys}, {nthreads} threads: {m}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", isas((1, 2)))
def test_a_row_is_the_same_in_any_batch_and_thread_count(isa):
    """The split the op picks depends on a row's own length only: each row of a ragged batch equals, bit for bit,
    the same row attended alone, beside other rows, and at one or two threads (the int8 linears would turn a
    last-bit difference into a different token)."""
    q, cache, kv_index, seq_lens = inputs(5, 9, 3, 64, [2000, 130, 64, 1, 700], seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = torch.ops.tandem.decode_attention(q, cache, 1, kv_index, seq_lens, 0.125, isa)
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            for r in range(5):
                alone = torch.ops.tandem.decode_attention(q[r:r + 1], cache, 1, kv_index[r:r + 1], seq_lens[r:r + 1],
                                                          0.125, isa)
                assert torch.equal(alone, full[r:r + 1]), (r, nthreads)
            pair = torch.ops.tandem.decode_attention(q[1:3], cache, 1, kv_index[1:3], seq_lens[1:3], 0.125, isa)
            assert torch.equal(pair, full[1:3])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_split_by_kv_heads_has_the_bits_of_one_task(isa, dtype):
    """Fewer tasks than threads: a row of one chunk is split into groups of its KV heads (split_heads), 2 or 3
    groups, even or not (12 heads over 3 KV heads), yet every head's output has the bits of one thread's single
    task, alone or beside another row."""
    threads = torch.get_num_threads()
    try:
        for h, kvh, lens in ((32, 4, [200, 31]), (12, 3, [256, 129])):
            q, cache, kv_index, seq_lens = inputs(2, h, kvh, 128, lens, seed=h)
            cache = cache.to(dtype)
            torch.set_num_threads(1)
            one = [torch.ops.tandem.decode_attention(q[r:r + 1], cache, 0, kv_index[r:r + 1], seq_lens[r:r + 1],
                                                     0.1, isa) for r in range(2)]
            for nthreads in (2, 3, 4):
                torch.set_num_threads(nthreads)
                pair = torch.ops.tandem.decode_attention(q, cache, 0, kv_index, seq_lens, 0.1, isa)
                for r in range(2):
                    alone = torch.ops.tandem.decode_attention(q[r:r + 1], cache, 0, kv_index[r:r + 1],
                                                              seq_lens[r:r + 1], 0.1, isa)
                    assert torch.equal(alone, one[r]) and torch.equal(pair[r:r + 1], one[r]), (h, r, nthreads)
    finally:
        torch.set_num_threads(threads)


def test_decode_attention_wrapper_and_errors():
    """The Python entry point runs the op as picked; bad shapes are refused with the op's name."""
    from tandem.kernels.attention import decode_attention
    q, cache, kv_index, seq_lens = inputs(2, 9, 3, 64, [40, 3], seed=1)
    torch.testing.assert_close(decode_attention(q, cache, 1, kv_index, seq_lens, 0.125),
                               decode_attention_ref(q, cache, 1, kv_index, seq_lens, 0.125), rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="seq_lens"):
        torch.ops.tandem.decode_attention(q, cache, 1, kv_index, torch.tensor([41, 3]), 0.125)
    with pytest.raises(RuntimeError, match="head shapes"):
        torch.ops.tandem.decode_attention(q[:, :8], cache, 1, kv_index, seq_lens, 0.125)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("b, h, kvh, d, lens", CASES)
def test_decode_attention_qkv_equals_reference(isa, b, h, kvh, d, lens):
    """The fused decode step (write each row's K/V at its slot, then attend) against its torch reference: the
    same output and the same cache, with qkv rows strided (a view into a wider buffer) as the engine never
    makes them but a caller may. Each row's new key is its last position, so it is read back at once."""
    from tandem.kernels.attention import decode_attention_qkv_ref
    _, cache, kv_index, seq_lens = inputs(b, h, kvh, d, lens, seed=len(lens) * d + h + 1)
    g = torch.Generator().manual_seed(b * h)
    width = (h + 2 * kvh) * d
    qkv = (torch.randn(b, width + 5, generator=g) * 2)[:, 3:3 + width]      # rows width + 5 apart
    slots = cache.shape[0]                       # each row's new token gets a slot of its own, past the pad slot
    cache = torch.cat([cache, torch.randn(b, *cache.shape[1:], generator=g)])
    loc = slots + torch.arange(b)
    kv_index[torch.arange(b), seq_lens - 1] = loc
    for layer in (0, 1):
        ref_cache = cache.clone()
        ref = decode_attention_qkv_ref(qkv, ref_cache, layer, loc, kv_index, seq_lens, d ** -0.5, h)
        for chunk_keys in (0, 32, -1):
            got_cache = cache.clone()
            got = torch.ops.tandem.decode_attention_qkv_(qkv, got_cache, layer, loc, kv_index, seq_lens, d ** -0.5,
                                                         h, isa, chunk_keys)
            assert got.shape == (b, h * d)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"chunk_keys {chunk_keys}: {m}")
            assert torch.equal(got_cache, ref_cache)


def test_decode_attention_qkv_wrapper_and_errors():
    from tandem.kernels.attention import decode_attention_qkv_, decode_attention_qkv_ref
    _, cache, kv_index, seq_lens = inputs(2, 9, 3, 64, [40, 3], seed=2)
    qkv = torch.randn(2, 15 * 64)
    loc = kv_index[torch.arange(2), seq_lens - 1]
    ref_cache = cache.clone()
    torch.testing.assert_close(decode_attention_qkv_(qkv, cache, 1, loc, kv_index, seq_lens, 0.125, 9),
                               decode_attention_qkv_ref(qkv, ref_cache, 1, loc, kv_index, seq_lens, 0.125, 9),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="qkv must be"):
        torch.ops.tandem.decode_attention_qkv_(qkv[:, :14 * 64], cache, 1, loc, kv_index, seq_lens, 0.125, 9)
    with pytest.raises(RuntimeError, match="out_cache_loc"):
        torch.ops.tandem.decode_attention_qkv_(qkv, cache, 1, torch.tensor([0, cache.shape[0]]), kv_index, seq_lens,
                                               0.125, 9)


WINDOW_CASES = [  # batch, query heads, KV heads, head_dim, keys per row, window
    (3, 4, 1, 256, [1, 700, 513], 512),        # Gemma 3: head_dim 256, one KV head, W 512 (rows shorter and longer)
    (4, 8, 2, 64, [5, 9, 64, 300], 8),         # a window shorter than a tile
    (1, 4, 1, 256, [4096], 512),               # batch 1 at a long context: the window split over threads
]


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("b, h, kvh, d, lens, window", WINDOW_CASES)
def test_sliding_window_decode_attention_equals_reference(isa, b, h, kvh, d, lens, window):
    """A sliding-window layer: each row attends only its last `window` keys (positions >= seq_len - window), in
    both ops, unsplit, split in fixed chunks and as picked; a key just outside the window is never read (its slot
    holds NaN, which would poison the output)."""
    from tandem.kernels.attention import decode_attention_qkv_ref
    q, cache, kv_index, seq_lens = inputs(b, h, kvh, d, lens, seed=window + d)
    seen = {int(s) for r, n in enumerate(lens) for s in kv_index[r, max(0, n - window):n]}
    outside = [s for s in range(cache.shape[0] - 1) if s not in seen]    # slots (shared by rows) in no window
    poisoned = cache.clone()
    poisoned[outside] = float("nan")
    assert max(lens) <= window or outside
    for layer in (0, 1):
        ref = decode_attention_ref(q, cache, layer, kv_index, seq_lens, d ** -0.5, window)
        full = decode_attention_ref(q, cache, layer, kv_index, seq_lens, d ** -0.5)
        assert max(lens) <= window or not torch.allclose(ref, full)
        for chunk_keys in (0, 32, -1):
            got = torch.ops.tandem.decode_attention(q, poisoned, layer, kv_index, seq_lens, d ** -0.5, isa,
                                                    chunk_keys, window)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    qkv = torch.randn(b, (h + 2 * kvh) * d)
    loc = kv_index[torch.arange(b), seq_lens - 1]
    ref_cache, got_cache = cache.clone(), poisoned.clone()
    ref = decode_attention_qkv_ref(qkv, ref_cache, 1, loc, kv_index, seq_lens, 0.1, h, window)
    got = torch.ops.tandem.decode_attention_qkv_(qkv, got_cache, 1, loc, kv_index, seq_lens, 0.1, h, isa, -1, window)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_cache[loc], ref_cache[loc])
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.tandem.decode_attention(q, cache, 0, kv_index, seq_lens, 0.1, isa, -1, -1)
