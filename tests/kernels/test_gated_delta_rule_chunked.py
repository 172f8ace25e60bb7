"""The delta rule's chunked form: the torch chunked reference (model/delta_chunked.py) against the recurrent one,
and the native op (csrc/gated_delta_rule_chunked.cpp) on every ISA body this CPU runs against the chunked
reference (tight) and the recurrent op (close); a row shorter than the chunk gets the recurrent op's very bits."""
from __future__ import annotations

import pytest
import torch

from tandem.model.delta_chunked import delta_rule_chunked_reference
from tandem.model.linear_attention import delta_rule_reference
from tests.helpers.isa import isas
from tests.kernels.test_gated_delta_rule import inputs, native, op, reference, starts_of

HK, HV = 2, 4


def chunked_reference(q, k, v, g, beta, state, slots, starts, fresh, chunk):
    """The torch chunked reference row by row (test_gated_delta_rule.py's reference with the chunked rule)."""
    return reference(q, k, v, g, beta, state, slots, starts, fresh,
                     rule=lambda *row: delta_rule_chunked_reference(*row, chunk))


def chunked_op(q, k, v, g, beta, state, slots, starts, fresh, chunk, isa):
    return torch.ops.tandem.gated_delta_rule_chunked_(
        q, k, v, g, beta, state, torch.tensor(slots, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
        torch.tensor(fresh, dtype=torch.bool), chunk, isa)


@pytest.mark.parametrize("chunk", [8, 16, 64])
@pytest.mark.parametrize("dk,dv", [(128, 128), (32, 88)])
@pytest.mark.parametrize("fresh", [True, False])
def test_reference_matches_recurrent(chunk, dk, dv, fresh):
    """Token counts that are no multiple of the chunk (a tail), GQA heads repeated, a fresh or carried-in state."""
    n = 2 * chunk + chunk // 2 + 3
    q, k, v, g, beta = inputs(n, dk, dv, seed=chunk + dv)
    r = HV // HK
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    init = torch.zeros(HV, dk, dv) if fresh else torch.randn(HV, dk, dv, generator=torch.Generator().manual_seed(9))
    want_state, got_state = init.clone(), init.clone()
    want = delta_rule_reference(q, k, v, g, beta, want_state)
    got = delta_rule_chunked_reference(q, k, v, g, beta, got_state, chunk)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=1e-4, rtol=1e-4)


def mixed_rows(dk: int, dv: int, chunk: int, seed: int):
    """Rows of mixed lengths (a decode token, shorter than a chunk, a chunk exactly, chunks and a tail), fresh and
    carried in, in slots out of order; a state pool with garbage in the fresh slots."""
    lens = [1, chunk - 3, chunk, 2 * chunk + 5, 3 * chunk + 1]
    slots, fresh = [4, 0, 6, 2, 5], [False, True, False, True, False]
    q, k, v, g, beta = inputs(sum(lens), dk, dv, seed=seed)
    state = torch.randn(8, HV, dk, dv, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    return (q, k, v, g, beta), state, slots, starts_of(lens), fresh


@native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("chunk", [8, 16, 32, 64])
@pytest.mark.parametrize("dk,dv", [(128, 128), (32, 88)])    # 88: whole register tiles, a register, plain columns
def test_op_matches_references(isa, chunk, dk, dv):
    """Several rows in one call: the op against the torch chunked reference (tight) and the recurrent op (close),
    the output state too (untouched slots included)."""
    x, state, slots, starts, fresh = mixed_rows(dk, dv, chunk, seed=chunk + dv)
    ref_state, rec_state = state.clone(), state.clone()
    want = chunked_reference(*x, ref_state, slots, starts, fresh, chunk)
    got = chunked_op(*x, state, slots, starts, fresh, chunk, isa)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-4)
    recurrent = op(*x, rec_state, slots, starts, fresh, isa)
    torch.testing.assert_close(got, recurrent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, rec_state, atol=1e-4, rtol=1e-4)


@native
@pytest.mark.parametrize("isa", isas())
def test_short_rows_keep_the_recurrent_bits(isa):
    """Rows shorter than the chunk (decode tokens among them) run the recurrent op's body: the same bits."""
    lens, slots, fresh = [1, 63, 1, 40], [3, 0, 1, 2], [False, True, False, True]
    q, k, v, g, beta = inputs(sum(lens), 128, 128, seed=5)
    init = torch.randn(4, HV, 128, 128, generator=torch.Generator().manual_seed(6)) * 0.1
    a, b = init.clone(), init.clone()
    got = chunked_op(q, k, v, g, beta, a, slots, starts_of(lens), fresh, 64, isa)
    want = op(q, k, v, g, beta, b, slots, starts_of(lens), fresh, isa)
    assert torch.equal(got, want) and torch.equal(a, b)


@native
@pytest.mark.parametrize("isa", isas())
def test_strong_decays(isa):
    """Decays whose sum over a chunk passes ln FLT_MIN (~-87: the op's exps give 0 there, not subnormals): the
    same values as the references."""
    x, state, slots, starts, fresh = mixed_rows(32, 88, 32, seed=8)
    x = (*x[:3], x[3] * 2 - 2, x[4])                 # g in about (-6, -2) a token: a chunk of 32 sums to ~-90
    ref_state, rec_state = state.clone(), state.clone()
    want = chunked_reference(*x, ref_state, slots, starts, fresh, 32)
    got = chunked_op(*x, state, slots, starts, fresh, 32, isa)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got, op(*x, rec_state, slots, starts, fresh, isa), atol=1e-4, rtol=1e-4)


@native
def test_bad_chunk_is_refused():
    x, state, slots, starts, fresh = mixed_rows(16, 16, 8, seed=1)
    with pytest.raises(RuntimeError, match="chunk must be positive"):
        chunked_op(*x, state, slots, starts, fresh, 0, -1)


def test_reference_rows_shorter_than_the_chunk_are_recurrent():
    """The chunked reference's tail is the recurrent reference itself: a chunk longer than every row, its bits."""
    x, state, slots, starts, fresh = mixed_rows(16, 16, 8, seed=2)
    a, b = state.clone(), state.clone()
    torch.testing.assert_close(chunked_reference(*x, a, slots, starts, fresh, 10 ** 6),
                               reference(*x, b, slots, starts, fresh), atol=0, rtol=0)
