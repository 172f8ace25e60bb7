"""The one sampling path: greedy, temperature, top-k, top-p and min-p, batched, on the device.

Each draw is inverse-CDF sampling with a single uniform per row, derived on the host from (seed, output
position) by a counter-based hash. So a request's draws depend only on its seed and its logits, never on
its batch mates, a retraction or the loop, and a draw costs about what a softmax costs (no torch.multinomial,
which costs ~2 ms per row over a 49k vocabulary here). Which rows take which branch is decided from the
host copy of the parameters, so sampling never synchronizes the host with a CUDA stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A uniform in (0, 1) for each (seed, output position), as float64."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = _splitmix64(_splitmix64(s) ^ (p * np.uint64(0xD1B54A32D192ED03)))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row parameters on the device, plus the branch plan made from their host copy."""
    temperature: torch.Tensor     # [b], the sampled rows only
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    uniform: torch.Tensor
    rows: torch.Tensor | None     # batch rows that sample (temperature > 0); None: all rows
    plain: torch.Tensor           # positions within the sampled rows that need no sort (no top-k/top-p)
    sort: torch.Tensor            # positions that do
    has_plain: bool
    has_sort: bool
    any_min_p: bool
    any_sampled: bool

    @classmethod
    def from_host(cls, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, min_p: np.ndarray,
                  uniform: np.ndarray, device: torch.device) -> "SamplingBatch":
        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype, non_blocking=True)

        sampled = np.nonzero(temperature > 0)[0]
        all_rows = len(sampled) == len(temperature)
        sel = slice(None) if all_rows else sampled
        tk, tp = top_k[sel], top_p[sel]
        needs_sort = (tk > 0) | (tp < 1.0)
        plain, sort = np.nonzero(~needs_sort)[0], np.nonzero(needs_sort)[0]
        return cls(temperature=dev(temperature[sel], torch.float32), top_p=dev(tp, torch.float32),
                   top_k=dev(tk, torch.int64), min_p=dev(min_p[sel], torch.float32),
                   uniform=dev(uniform[sel], torch.float64),
                   rows=None if all_rows else dev(sampled, torch.int64),
                   plain=dev(plain, torch.int64), sort=dev(sort, torch.int64),
                   has_plain=len(plain) > 0, has_sort=len(sort) > 0,
                   any_min_p=bool((min_p[sel] > 0).any()), any_sampled=len(sampled) > 0)


def sample(logits: torch.Tensor, p: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] fp32. Returns token ids [B] (int64)."""
    tokens = logits.argmax(dim=-1)                                   # greedy rows
    if not p.any_sampled:
        return tokens
    sub = logits if p.rows is None else logits[p.rows]
    probs = torch.softmax(sub / p.temperature[:, None], dim=-1)      # [b, V]
    if p.any_min_p:
        probs = probs.masked_fill(probs < p.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if not p.has_sort:
        choice = _inverse_cdf(probs, p.uniform)
    elif not p.has_plain:
        choice = _sorted_draw(probs, p.top_k, p.top_p, p.uniform)
    else:
        choice = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        choice[p.plain] = _inverse_cdf(probs[p.plain], p.uniform[p.plain])
        choice[p.sort] = _sorted_draw(probs[p.sort], p.top_k[p.sort], p.top_p[p.sort], p.uniform[p.sort])
    if p.rows is None:
        return choice
    return tokens.index_copy(0, p.rows, choice)


def _sorted_draw(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)
    k = torch.where(top_k > 0, top_k, sorted_probs.shape[-1])
    sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= k[:, None], 0.0)
    above = sorted_probs.cumsum(dim=-1) - sorted_probs               # mass ranked strictly above each token
    total = sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs.masked_fill(above >= top_p[:, None] * total, 0.0)
    sorted_probs[:, 0] = sorted_probs[:, 0].clamp_min(1e-30)          # the top token always survives
    pick = _inverse_cdf(sorted_probs, u)
    return order.gather(1, pick[:, None]).squeeze(1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)                                        # [b, V]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)
    # Never land on a zero-probability token (a float boundary at a masked entry): fall back to the mode.
    zero = probs.gather(1, pick[:, None]).squeeze(1) <= 0
    return torch.where(zero, probs.argmax(dim=-1), pick)
