"""The chunked (matrix) form of the Gated DeltaNet delta rule, in torch: the reference of the native
gated_delta_rule_chunked_ op (csrc/gated_delta_rule_chunked.cpp), which long prefill rows take where batch
invariance is off (linear_attention.py).

Why: the recurrent form reads and writes each head's [Dk, Dv] state twice a token, so it waits on the cache, not
on the FMA units. Over a chunk of C tokens the same rule is a few dense products of [C, D] by [D, D] or [C, C]
matrices, which a register-blocked loop runs near the core's FMA rate; the state is read and written once a
chunk. The price: a token's bits depend on where its chunk starts (sums in another order), so the engine's batch
invariance keeps the recurrent form.

Within a chunk (tokens t = 0..C-1, state S0 before it, gam_t = g_0 + ... + g_t, every exponent <= 0 as g <= 0):
    delta_t = beta_t (v_t - exp(gam_t) S0^T k_t) - beta_t sum_{s<t} exp(gam_t - gam_s) (k_t . k_s) delta_s
(a unit lower-triangular system, solved by forward substitution), then
    o_t = exp(gam_t) S0^T q_t + sum_{s<=t} exp(gam_t - gam_s) (q_t . k_s) delta_s
    S   = exp(gam_last) S0 + sum_s exp(gam_last - gam_s) k_s delta_s^T
which unrolls the recurrent rule (S <- exp(g) S; S <- S + k delta^T, delta = beta (v - (exp(g) S)^T k)) over the
chunk: the same values up to rounding.
"""
from __future__ import annotations

import torch

from .linear_attention import delta_rule_reference


def delta_rule_chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, state: torch.Tensor, chunk: int) -> torch.Tensor:
    """One request's tokens as delta_rule_reference takes them (q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H];
    state [H, Dk, Dv] updated in place): its full chunks of `chunk` tokens from its first in the matrix form,
    the tail shorter than `chunk` token by token (so a decode token's arithmetic is the recurrent op's)."""
    n = q.shape[0]
    full = n - n % chunk
    out = torch.empty_like(v)
    for c0 in range(0, full, chunk):
        c = slice(c0, c0 + chunk)
        out[c] = chunk_reference(q[c], k[c], v[c], g[c], beta[c], state)
    if full < n:
        out[full:] = delta_rule_reference(q[full:], k[full:], v[full:], g[full:], beta[full:], state)
    return out


def chunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """One chunk's C tokens in the matrix form (the module docstring's equations), heads first; state [H, Dk,
    Dv] advanced over the chunk in place. Returns o [C, H, Dv]."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))                    # [H, C, D]
    gam = g.t().cumsum(dim=-1)                                          # [H, C]
    beta = beta.t()[..., None]                                          # [H, C, 1]
    n = q.shape[1]
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # exp(gam_t - gam_s) for s <= t, 0 above the diagonal (masked before exp: the exponents there are > 0)
    decay = (gam[:, :, None] - gam[:, None, :]).masked_fill(~lower, float("-inf")).exp()
    a = (beta * (k @ k.transpose(1, 2)) * decay).tril(-1)               # sum_{s<t} a[t, s] delta_s
    rhs = beta * (v - gam.exp()[..., None] * (k @ state))
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    delta = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    o = gam.exp()[..., None] * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ delta
    last = gam[:, -1:]                                                  # [H, 1]
    kd = k * (last - gam).exp()[..., None]
    state.mul_(last.exp()[..., None]).add_(kd.transpose(1, 2) @ delta)
    return o.transpose(0, 1)
