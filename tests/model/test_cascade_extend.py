"""Shared-prefix (cascade) attention for extend steps (model/cascade.py): rows on one cached prefix attend it
as one attention of all their new tokens, merged with their own keys by log-sum-exp. It equals one masked
attention over each row's whole layout up to fp32 rounding (the torch reference here), the executor finds the
longest common slots inside every row's cached part, and end to end (exact mode) the engine gives the same
greedy tokens and logprobs within 1e-4 with it on and off, in both loops, with chunked prefill and mixed
steps, and no leaked slot."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.model import cascade
from tandem.model.cascade import MIN_SHARED, additive, cascade_attention, shared_prefix


@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_cascade_equals_one_attention(h, kvh, d):
    """Ragged rows on a P-key prefix (one with cached keys of its own after it, padded query slots): the
    merged result equals SDPA over every row's whole [prefix + own] layout with the causal mask."""
    g = torch.Generator().manual_seed(0)
    p, ext, own_cached = 70, [5, 1, 9, 3], [0, 4, 0, 2]        # new tokens and cached keys after the prefix
    b, lq = len(ext), max(ext)
    ls = max(c + e for c, e in zip(own_cached, ext))
    pk, pv = torch.randn(1, kvh, p, d, generator=g), torch.randn(1, kvh, p, d, generator=g)
    keys, values = torch.randn(b, kvh, ls, d, generator=g), torch.randn(b, kvh, ls, d, generator=g)
    q = torch.randn(sum(ext), h, d, generator=g)
    rows = torch.repeat_interleave(torch.arange(b), torch.tensor(ext))
    starts = torch.tensor(np.cumsum([0] + ext[:-1]))
    cols = torch.arange(len(rows)) - starts[rows]
    q_index = torch.zeros(b, lq, dtype=torch.long)
    mask = torch.zeros(b, 1, lq, ls, dtype=torch.bool)
    for r in range(b):
        n = own_cached[r] + ext[r]
        for c in range(lq):
            if c < ext[r]:
                q_index[r, c] = starts[r] + c
                mask[r, 0, c, :own_cached[r] + c + 1] = True
            else:
                mask[r, 0, c, :n] = True                          # a padded slot sees its row's keys
    queries = q[q_index].transpose(1, 2)
    got = cascade_attention(q, (pk, pv), queries, keys, values, additive(mask, q.dtype), (rows, cols), 0.125)
    full_k = torch.cat([pk.expand(b, -1, -1, -1), keys], 2)
    full_v = torch.cat([pv.expand(b, -1, -1, -1), values], 2)
    full_mask = torch.cat([torch.ones(b, 1, lq, p, dtype=torch.bool), mask], -1)
    ref = F.scaled_dot_product_attention(queries, full_k, full_v, attn_mask=full_mask, scale=0.125, enable_gqa=True)
    ref = ref.transpose(1, 2)[rows, cols].reshape(len(rows), -1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_shared_prefix_length():
    base = torch.arange(100, 400)
    kv = torch.stack([base, base.clone(), base.clone()])
    assert shared_prefix(kv, np.array([200, 250, 300])) == 200          # bounded by the least cached row
    kv[2, 150:] += 1000                                                 # a row branches off at 150
    assert shared_prefix(kv, np.array([200, 250, 300])) == 150
    kv[1, MIN_SHARED - 1] = 0                                           # common part below the minimum
    assert shared_prefix(kv, np.array([200, 250, 300])) == 0
    assert shared_prefix(kv[:1], np.array([300])) == 0                  # one row: nothing to share
    assert shared_prefix(kv, np.array([10, 250, 300])) == 0


@pytest.mark.parametrize("scheduler", ["serial", "overlap"])
def test_engine_on_equals_off(tiny_llama, make_llm, monkeypatch, scheduler):
    """16 requests on a cached 120-token prefix with 20-70 own tokens each, chunked (max_prefill_tokens 256)
    and mixed with running decode rows: the same greedy tokens and logprobs (1e-4) with the cascade on and
    off in the exact mode, and the cascade ran only when on. The torch path: with native kernels long chunks
    attend by the extend op, which reads keys in place and has no split (tests/kernels/test_extend_attention.py)."""
    from tandem import SamplingParams
    from tandem.model import attention_paths
    calls = {"n": 0}

    def counted(*a, **kw):
        calls["n"] += 1
        return cascade.cascade_attention(*a, **kw)
    monkeypatch.setattr(attention_paths, "cascade_attention", counted)
    prefix = [(7 * i) % 200 + 3 for i in range(120)]
    prompts = [prefix + [(11 * i + 5 * j) % 250 + 2 for j in range(20 + 3 * i)] for i in range(16)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = []
    for share in (True, False):
        calls["n"] = 0
        llm = make_llm(tiny_llama, scheduler=scheduler, shared_prefix_attention=share, device_backend="inline",
                       kernels_act="fp32", max_prefill_tokens=256, kernels="torch")
        llm.generate([prefix + [9]], SamplingParams(max_tokens=1), use_tqdm=False)    # the prefix is cached
        first = llm.generate(prompts[:2], sp, use_tqdm=False)
        rest = llm.generate(prompts, sp, use_tqdm=False)
        outs.append([o.outputs[0] for o in first + rest])
        assert (calls["n"] > 0) == share
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
