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

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ISAS = [0, 1, 2]


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
@pytest.mark.parametrize("isa", ISAS)
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
@pytest.mark.parametrize("isa", ISAS)
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
    from tandem.model import llama
    calls = {"n": 0}
    real = llama.extend_attention

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(llama, "extend_attention", counted)
    prefix = [(7 * i) % 200 + 3 for i in range(120)]
    prompts = [prefix + [(11 * i + 5 * j) % 250 + 2 for j in range(20 + 3 * i)] for i in range(16)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = {}
    for k in ("native", "torch"):
        llm = make_llm(tiny_llama, scheduler=scheduler, kernels=k, device_backend="inline", kernels_act="fp32",
                       max_prefill_tokens=256)
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
