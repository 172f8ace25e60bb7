"""The one sampling path: greedy, temperature, top-k, top-p and min-p, batched, on the device.

Each draw is inverse-CDF sampling with a single uniform per row, derived on the host from (seed, output
position) by a counter-based hash. So a request's draws depend only on its seed and its logits, never on
its batch mates, a retraction or the loop, and a draw costs about what argmax costs (no torch.multinomial,
which costs ~2 ms per row over a 49k vocabulary here).
"""
from __future__ import annotations

import numpy as np
import torch

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


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


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] fp32; per-row params: [B]. Returns token ids [B] (int64)."""
    tokens = logits.argmax(dim=-1)                                   # greedy rows, and the fallback
    sampled = temperature > 0
    if not bool(sampled.any()):
        return tokens
    idx = sampled.nonzero().squeeze(1)
    probs = torch.softmax(logits[idx] / temperature[idx, None], dim=-1)  # [b, V]
    mp = min_p[idx]
    if bool((mp > 0).any()):
        probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    u = uniform[idx].to(probs.dtype)
    tk, tp = top_k[idx], top_p[idx]
    needs_sort = (tk > 0) | (tp < 1.0)
    choice = torch.empty_like(idx)
    plain = (~needs_sort).nonzero().squeeze(1)
    if plain.numel():
        choice[plain] = _inverse_cdf(probs[plain], u[plain])
    sort = needs_sort.nonzero().squeeze(1)
    if sort.numel():
        sorted_probs, order = probs[sort].sort(dim=-1, descending=True)
        ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)
        k = torch.where(tk[sort] > 0, tk[sort], sorted_probs.shape[-1])
        sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= k[:, None], 0.0)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs           # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= tp[sort, None] * before[:, -1:].add(
            sorted_probs[:, -1:]), 0.0)
        sorted_probs[:, 0] = sorted_probs[:, 0].clamp_min(1e-30)       # the top token always survives
        pick = _inverse_cdf(sorted_probs, u[sort])
        choice[sort] = order.gather(1, pick[:, None]).squeeze(1)
    tokens[idx] = choice
    return tokens


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)                                        # [b, V]
    target = (u * cdf[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(cdf, target, right=True).squeeze(1)
    pick = pick.clamp_max(probs.shape[-1] - 1)
    # Never land on a zero-probability token (a boundary at a masked entry).
    zero = probs.gather(1, pick[:, None]).squeeze(1) <= 0
    if bool(zero.any()):
        pick = torch.where(zero, probs.argmax(dim=-1), pick)
    return pick
