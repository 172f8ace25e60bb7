"""top-k / top-p without a full sort (sampler._top_k_top_p) against its definition, one full stable sort
(sampler._top_k_top_p_reference): equal masks, bit for bit, over random logits with cuts near the head, deep
in the tail (flat rows, top_p near 1), ties (coarse logits, a uniform row) and masked (-inf) tokens."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tandem import sampler
from tandem.sampler import SamplingBatch, _top_k_top_p, _top_k_top_p_reference, draw_seeds, sample


def _rows(vocab: int, n: int, seed: int) -> torch.Tensor:
    """n rows of z = log(p / p_max): peaked, flat, coarse (ties everywhere) and grammar-masked."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * torch.tensor([4.0, 1.0, 0.3, 0.05])[torch.arange(n) % 4, None]
    x[1::5] = (x[1::5] * 2).round() / 2                              # ties straddle every cut
    x[2::7, vocab // 3:] = -math.inf                                 # a grammar mask
    return x - x.max(dim=-1, keepdim=True).values


def _check(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    vocab = z.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)
    fast, ref = _top_k_top_p(z, top_k, top_p), _top_k_top_p_reference(z, k, top_p)
    assert torch.equal(fast, ref), (fast != ref).any(dim=-1).nonzero().squeeze(1).tolist()


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99, 0.999, 1.0])
@pytest.mark.parametrize("top_k", [-1, 1, 7, 300])
def test_fast_cut_equals_the_full_sort(top_p, top_k, monkeypatch):
    monkeypatch.setattr(sampler, "TOP_CANDIDATES", 64)               # most cuts lie past the first stage
    z = _rows(3000, 16, seed=int(top_p * 1000) + top_k)
    _check(z, torch.full((16,), top_k), torch.full((16,), top_p))


def test_mixed_rows_and_uniform_rows(monkeypatch):
    monkeypatch.setattr(sampler, "TOP_CANDIDATES", 32)
    z = _rows(2000, 12, seed=5)
    z[3] = 0.0                                                       # all tied: every cut splits the tie
    z[7, 1::2] = z[7, 0::2]                                          # pairs of twins
    top_p = torch.tensor([0.5, 0.99, 1.0, 0.7, 0.999, 0.95, 0.9, 0.8, 1.0, 0.6, 0.99, 0.999])
    top_k = torch.tensor([-1, -1, 40, 100, 2000, 5, -1, 33, 1500, -1, 64, 31])
    _check(z, top_k, top_p)


def test_grammar_rows_stay_on_the_first_stage(monkeypatch):
    """A grammar mask leaves most tokens -inf: top-k past the allowed ones (or top_p near 1) splits that tie
    group, which changes no output, so the row needs no threshold pass."""
    z = _rows(5000, 6, seed=8)
    z[:, 3:] = -math.inf
    z[:, 0] = 0.0
    monkeypatch.setattr(sampler, "_threshold_cut", None)              # calling it fails the test
    _check(z, torch.tensor([50, 2, -1, 1024, 5000, 7]), torch.tensor([1.0, 1.0, 0.999999, 0.9, 1.0, 0.5]))


def test_large_vocabulary_deep_cuts():
    """Gemma 3's 262,144 tokens at the default TOP_CANDIDATES: cuts at ~10^2 .. 10^5 tokens."""
    z = _rows(262144, 4, seed=9)
    _check(z, torch.tensor([-1, -1, 5000, -1]), torch.tensor([0.9, 0.99, 0.999, 0.9999]))


def test_threshold_cut_says_when_its_tokens_do_not_decide():
    """A threshold that leaves out part of what top-p keeps (the histogram never picks one) is reported as
    undecided (the caller takes the reference); every other threshold gives the reference's rows."""
    z = _rows(4000, 4, seed=3)
    k, top_p = torch.full((4,), 4000), torch.full((4,), 0.99)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    ref = _top_k_top_p_reference(z, k, top_p)
    out, decided = sampler._threshold_cut(z, lse, k, top_p, torch.tensor([-0.5, -math.inf, -40.0, -1e-3]))
    assert decided.tolist() == [False, True, True, False]
    assert torch.equal(out[1:3], ref[1:3])
    mid = torch.tensor([-0.5, -math.inf, -40.0, -1e-3])
    out, decided = sampler._threshold_cut(z, lse, torch.tensor([1, 4000, 4000, 1]), top_p, mid)
    assert decided.tolist() == [True, True, True, True]
    assert torch.equal(out, _top_k_top_p_reference(z, torch.tensor([1, 4000, 4000, 1]), top_p))


def test_sample_draws_from_the_reference_cut():
    """The whole sampling path: a top-p row's token is the race over the reference's kept tokens."""
    vocab, n = 262144, 3
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)) * 2
    t, top_p = 1.5, 0.99
    seeds = draw_seeds(np.arange(n), np.full(n, 4))
    p = SamplingBatch.from_host(np.full(n, t), np.full(n, top_p), np.full(n, -1), np.zeros(n), seeds,
                                torch.device("cpu"))
    z = logits / t
    z = z - z.max(dim=-1, keepdim=True).values
    kept = _top_k_top_p_reference(z, torch.full((n,), vocab), torch.full((n,), top_p))
    expect = (kept - sampler.race_noise(p.draw_seeds, vocab)).argmax(dim=-1)
    assert sample(logits, p).tolist() == expect.tolist()
