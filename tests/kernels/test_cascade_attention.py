"""Shared-prefix (cascade) attention in the native decode op (csrc/shared_prefix_attention.cpp): rows whose keys
start with the same KV slots read them once for all, up to 8 rows of a chunk attending it together (each K and
V row loaded and widened once for all their query heads). Its invariant is that it changes no bit: every row's
output equals, bit for bit, the op with sharing off, the row attended alone and the row at another thread
count; and it equals the torch reference (gather, then SDPA). Checked with several sharing groups in one
batch, rows that branch off a common prefix, a row whose slots are a prefix of another's (a verify step),
sliding windows, fp32 and bf16 caches and contexts 1 to 4k; and end to end, on == off on a shared prompt."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels.attention import decode_attention_qkv_ref, decode_attention_ref
from tests.helpers.isa import isas, runnable

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")


def shared_batch(specs, kvh=3, d=64, dtype=torch.float32, seed=0):
    """specs: per row (group, shared keys, own keys). Rows of one group take the group's first `shared` slots
    (a prefix cached once), then slots of their own. Returns cache [S + 1, 2, 2, KVH, D], kv_index, seq_lens."""
    g = torch.Generator().manual_seed(seed)
    longest = max(s for _, s, _ in specs)
    prefix = {grp: torch.randperm(10_000, generator=g)[:longest] for grp, _, _ in specs}
    rows, nxt = [], 10_000
    for grp, shared, own in specs:
        rows.append(torch.cat([prefix[grp][:shared], torch.arange(nxt, nxt + own)]))
        nxt += own
    lens = torch.tensor([len(r) for r in rows])
    lk = int(lens.max())
    pad = nxt
    kv_index = torch.full((len(rows), lk), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        kv_index[i, :len(r)] = r
    cache = torch.randn(pad + 1, 2, 2, kvh, d, generator=g).to(dtype)
    cache[pad] = 0
    return cache, kv_index, lens


def run(q, cache, kv_index, lens, isa, share, threads=2, window=0, chunk_keys=-1):
    old_t, old = torch.get_num_threads(), torch.ops.tandem.shared_prefix_attention(-1)
    try:
        torch.set_num_threads(threads)
        torch.ops.tandem.shared_prefix_attention(int(share))
        return torch.ops.tandem.decode_attention(q, cache, 1, kv_index, lens, 0.125, isa, chunk_keys, window)
    finally:
        torch.ops.tandem.shared_prefix_attention(old)
        torch.set_num_threads(old_t)


BATCHES = {
    "one group": [(0, 900, 24 + i) for i in range(8)],
    "three groups and loners": [(0, 900, 3), (1, 300, 40), (0, 900, 1), (2, 2000, 7), (1, 300, 1), (3, 0, 500),
                                (2, 2000, 90), (0, 900, 60), (4, 5, 1), (2, 2000, 2000)],
    "branching": [(0, 700, 1), (0, 256, 300), (0, 256, 301), (0, 64, 30), (0, 1000, 5)],
    "long": [(0, 4000, 1), (0, 4000, 30), (0, 3000, 96)],
    # more rows on one prefix than a shared task carries (MAX_SHARED_ROWS = 8): a chunk's rows split over tasks
    "many rows": [(0, 600, 1 + 3 * i) for i in range(19)] + [(1, 200, 5), (1, 200, 70)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("name", list(BATCHES))
def test_sharing_changes_no_bit(name, isa, dtype):
    cache, kv_index, lens = shared_batch(BATCHES[name], dtype=dtype, seed=len(name))
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(1)) * 3
    before = torch.ops.tandem.shared_prefix_attention(-2)
    on = run(q, cache, kv_index, lens, isa, True)
    assert torch.ops.tandem.shared_prefix_attention(-2) > before, "no chunk was shared"
    assert torch.equal(on, run(q, cache, kv_index, lens, isa, False))
    assert torch.equal(on, run(q, cache, kv_index, lens, isa, True, threads=1))
    for r in (0, len(lens) - 1):
        alone = run(q[r:r + 1], cache, kv_index[r:r + 1], lens[r:r + 1], isa, True)
        assert torch.equal(alone, on[r:r + 1]), r
    torch.testing.assert_close(on, decode_attention_ref(q, cache, 1, kv_index, lens, 0.125), rtol=1e-4, atol=1e-5)
    forced = run(q, cache, kv_index, lens, isa, True, chunk_keys=96)            # a forced split shares too
    assert torch.equal(forced, run(q, cache, kv_index, lens, isa, False, chunk_keys=96))


@pytest.mark.parametrize("h, kvh, d", [(4, 1, 256), (8, 2, 128), (6, 2, 24)])
def test_other_head_shapes(h, kvh, d):
    """Gemma 3's heads (4 query heads on one KV head of 256), GQA 4 at 128, and a head_dim off the SIMD width."""
    cache, kv_index, lens = shared_batch(BATCHES["three groups and loners"], kvh=kvh, d=d, dtype=torch.bfloat16)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(4))
    for isa in runnable():
        on = run(q, cache, kv_index, lens, isa, True)
        assert torch.equal(on, run(q, cache, kv_index, lens, isa, False))
        torch.testing.assert_close(on, decode_attention_ref(q, cache, 1, kv_index, lens, 0.125), rtol=1e-4,
                                   atol=1e-5)


def test_verify_rows_and_windows_share_or_not_as_they_should():
    """A verify step's rows of one request (each a prefix of the next) share; rows of a sliding-window layer
    share only while their windows start at key 0; the fused op (write, then attend) agrees with sharing off."""
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(3000, generator=g)[:1505]          # the request's slots: 1500 cached, 5 new
    vlens = 1501 + torch.arange(5)                              # row r: the request's token r of the step
    pad = 3000
    verify = torch.full((5, 1505), pad, dtype=torch.long)
    for r in range(5):
        verify[r, :vlens[r]] = slots[:vlens[r]]
    cache = torch.randn(pad + 1, 2, 2, 3, 64, generator=g)
    cache[pad] = 0
    q = torch.randn(5, 9, 64, generator=torch.Generator().manual_seed(2))
    for isa in runnable():
        before = torch.ops.tandem.shared_prefix_attention(-2)
        on = run(q, cache, verify, vlens, isa, True)
        assert torch.ops.tandem.shared_prefix_attention(-2) > before
        assert torch.equal(on, run(q, cache, verify, vlens, isa, False))
        for window in (512, 4096):          # 512: every window has moved off key 0, nothing is shared
            before = torch.ops.tandem.shared_prefix_attention(-2)
            got = run(q, cache, verify, vlens, isa, True, window=window)
            shared = torch.ops.tandem.shared_prefix_attention(-2) > before
            assert shared == (window == 4096)
            assert torch.equal(got, run(q, cache, verify, vlens, isa, False, window=window))
        qkv = torch.randn(5, 15 * 64)
        loc = verify[torch.arange(5), vlens - 1]
        a, b = cache.clone(), cache.clone()
        torch.ops.tandem.shared_prefix_attention(1)
        got = torch.ops.tandem.decode_attention_qkv_(qkv, a, 1, loc, verify, vlens, 0.125, 9, isa)
        torch.ops.tandem.shared_prefix_attention(0)
        off = torch.ops.tandem.decode_attention_qkv_(qkv, b, 1, loc, verify, vlens, 0.125, 9, isa)
        torch.ops.tandem.shared_prefix_attention(1)
        assert torch.equal(got, off) and torch.equal(a, b)
        ref = decode_attention_qkv_ref(qkv, cache.clone(), 1, loc, verify, vlens, 0.125, 9)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheduler", ["serial", "overlap"])
def test_engine_on_equals_off(tiny_llama, tmp_path, make_llm, scheduler):
    """32 requests on one 300-token prompt prefix (the radix cache shares its KV): the same greedy and seeded
    tokens with shared_prefix_attention on and off, in both loops, and the op did share."""
    from tandem import SamplingParams
    from tests.helpers.tiny_models import write_tiny_gguf
    gguf = str(write_tiny_gguf(tmp_path / "q8.gguf", tiny_llama, quant="Q8_0"))
    prefix = [(7 * i) % 200 + 3 for i in range(300)]
    prompts = [prefix + [11 + i, 40 + 2 * i] for i in range(32)]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(32)]
    outs = []
    for share in (True, False):
        llm = make_llm(gguf, scheduler=scheduler, shared_prefix_attention=share, device_backend="inline")
        llm.generate(prompts[:1], params[0], use_tqdm=False)              # the prefix enters the radix cache
        before = torch.ops.tandem.shared_prefix_attention(-2)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert (torch.ops.tandem.shared_prefix_attention(-2) > before) == share
    assert outs[0] == outs[1]
