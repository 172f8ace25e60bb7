"""The Gated DeltaNet delta rule: the native op (csrc/gated_delta_rule.cpp) against the torch reference
(model/linear_attention.py's delta_rule_reference) on every ISA body this CPU runs, its bits independent of how a
row's tokens are split over calls and of the rows beside it; and the reference against transformers' own."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.model.linear_attention import delta_rule_reference, l2norm
from tests.helpers.isa import isas, runnable

native = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: {kernels.unavailable_reason()}")
HK, HV = 2, 4                       # GQA: each key head serves two value heads


def raw(n: int, dk: int, dv: int, gen: torch.Generator, hk: int = HK, hv: int = HV):
    """A row's un-normed q, k [n, Hk, Dk], v [n, Hv, Dv] and its a / b logits [n, Hv] -> decay g < 0, beta in (0, 1)."""
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(n, hv, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(n, hv, generator=gen))
    return q, k, v, g, beta


def inputs(n: int, dk: int, dv: int, seed: int = 0):
    """The op's q, k (normed, q scaled), v, g, beta for n tokens."""
    q, k, v, g, beta = raw(n, dk, dv, torch.Generator().manual_seed(seed))
    return l2norm(q) * dk ** -0.5, l2norm(k), v, g, beta


def reference(q, k, v, g, beta, state, slots, starts, fresh, rule=delta_rule_reference):
    """The torch reference row by row, as the layer's torch path runs it; state updated in place. rule: one row's
    (q, k, v, g, beta, state) -> o (the recurrent reference, or the chunked one at a chunk size)."""
    r = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    o = torch.zeros_like(v)
    for slot, s, e, f in zip(slots, starts, starts[1:], fresh):
        if f:
            state[slot].zero_()
        o[s:e] = rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state[slot])
    return o


def op(q, k, v, g, beta, state, slots, starts, fresh, isa, fresh_dtype=torch.bool):
    return torch.ops.tandem.gated_delta_rule_(q, k, v, g, beta, state, torch.tensor(slots, dtype=torch.int64),
                                              torch.tensor(starts, dtype=torch.int64),
                                              torch.tensor(fresh, dtype=fresh_dtype), isa)


def starts_of(lens: list[int]) -> list[int]:
    return [sum(lens[:i]) for i in range(len(lens) + 1)]


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dk,dv", [(16, 16), (128, 128), (32, 88)])   # 88: a block, a register and a plain tail
def test_matches_reference(isa, dk, dv):
    lens, slots, fresh = [1, 9, 50, 1, 13], [3, 0, 5, 1, 6], [True, False, True, False, True]
    q, k, v, g, beta = inputs(sum(lens), dk, dv, seed=dk + dv)
    state = torch.randn(8, HV, dk, dv, generator=torch.Generator().manual_seed(1)) * 0.1   # fresh slots: garbage
    ref_state = state.clone()
    want = reference(q, k, v, g, beta, ref_state, slots, starts_of(lens), fresh)
    got = op(q, k, v, g, beta, state, slots, starts_of(lens), fresh, isa, torch.uint8 if dk == 32 else torch.bool)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-6, rtol=1e-4)      # untouched slots included


@native
def test_split_invariance():
    """A row's 40 tokens in one call or in four (decode-sized pieces among them): the same bits."""
    q, k, v, g, beta = inputs(40, 128, 128, seed=7)
    for isa in runnable():
        whole = torch.randn(2, HV, 128, 128, generator=torch.Generator().manual_seed(2))
        split = whole.clone()
        o_whole = op(q, k, v, g, beta, whole, [1], [0, 40], [True], isa)
        parts, s = [], 0
        for n in (1, 7, 20, 12):
            sl = slice(s, s + n)
            parts.append(op(q[sl], k[sl], v[sl], g[sl], beta[sl], split, [1], [0, n], [s == 0], isa))
            s += n
        assert torch.equal(torch.cat(parts), o_whole), isa
        assert torch.equal(split, whole), isa


@native
def test_batch_invariance():
    """A row alone and the same row between others (other slots, other lengths): the same bits."""
    dk = dv = 128
    q, k, v, g, beta = inputs(30, dk, dv, seed=3)
    oq, ok, ov, og, ob = inputs(25, dk, dv, seed=4)
    init = torch.randn(4, HV, dk, dv, generator=torch.Generator().manual_seed(5)) * 0.1
    for isa in runnable():
        alone = init.clone()
        o_alone = op(q, k, v, g, beta, alone, [2], [0, 30], [False], isa)
        among = init.clone()
        cat = [torch.cat([a[:5], x, a[5:]]) for a, x in zip((oq, ok, ov, og, ob), (q, k, v, g, beta))]
        o_among = op(*cat, among, [0, 2, 3], [0, 5, 35, 55], [True, False, False], isa)
        assert torch.equal(o_among[5:35], o_alone), isa
        assert torch.equal(among[2], alone[2]), isa


def test_reference_matches_transformers():
    """delta_rule_reference on our normed q / k against transformers' recurrent rule on the raw ones
    (it L2-norms and scales them itself; layout [B, T, H, D])."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule
    gen = torch.Generator().manual_seed(11)
    n, dk, dv = 24, 32, 16
    q, k, v, g, beta = raw(n, dk, dv, gen)
    state = torch.randn(HV, dk, dv, generator=gen) * 0.1
    want, want_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                        initial_state=state[None].clone(), output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    r = HV // HK
    qn = (l2norm(q) * dk ** -0.5).repeat_interleave(r, dim=1)
    kn = l2norm(k).repeat_interleave(r, dim=1)
    ours = state.clone()
    got = delta_rule_reference(qn, kn, v, g, beta, ours)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(ours, want_state[0], atol=1e-6, rtol=1e-4)
