"""The one sampling path: greedy, temperature, top-k, top-p and min-p, batched, on the device.

A draw is an exponential race (argmax of p_i / E_i with E_i ~ Exp(1), the Gumbel-max trick), taken in log
space: argmax of z_i - log E_i with z the tempered logits. The noise is a counter-based hash of (row seed,
token id), the row seed a hash of (request seed, output position) alone, so a request's draws never depend on
its batch mates, a retraction or the loop, and a kernel can compute any token's noise where it needs it. The
race is also robust to float noise in the logits (a batch of another size rounds a little differently): a
flip needs two tokens' noisy scores within ~1e-6, where inverse-CDF sampling over the 49k-token vocabulary
flips whenever the noise moves a CDF boundary past the draw. On CPU the noise, divide, subtract and argmax
are one pass of the native `race_argmax` (~130 us a row of 49,152 tokens with AVX-512, against ~650 us for
mt19937 noise plus the torch passes it replaced), with the torch reference below. Branches are planned from the host copy of the
parameters, so sampling never synchronizes the host with a CUDA stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def draw_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The noise seed of each (request seed, output position): a non-negative int64."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = _splitmix64(_splitmix64(s) ^ (p * np.uint64(0xD1B54A32D192ED03)))
    return (x >> np.uint64(1)).astype(np.int64)


@dataclass
class SamplingBatch:
    """Per-row parameters on the device, plus the branch plan made from their host copy."""
    temperature: torch.Tensor     # [b], the sampled rows only
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    draw_seeds: torch.Tensor      # [b] int64: the noise seed of each sampled row
    rows: torch.Tensor | None     # batch rows that sample (temperature > 0); None: all rows
    sort: torch.Tensor            # positions within the sampled rows that need a sort (top-k / top-p)
    has_sort: bool
    any_min_p: bool
    any_sampled: bool

    @classmethod
    def from_host(cls, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, min_p: np.ndarray,
                  draw_seed: np.ndarray, device: torch.device) -> "SamplingBatch":
        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype, non_blocking=True)

        sampled = np.nonzero(temperature > 0)[0]
        if not len(sampled):            # every row greedy: sample() reads none of the tensors
            none = torch.empty(0, device=device)
            return cls(none, none, none, none, none, None, none, False, False, False)
        all_rows = len(sampled) == len(temperature)
        sel = slice(None) if all_rows else sampled
        tk, tp = top_k[sel], top_p[sel]
        sort = np.nonzero((tk > 0) | (tp < 1.0))[0]
        return cls(temperature=dev(temperature[sel], torch.float32), top_p=dev(tp, torch.float32),
                   top_k=dev(tk, torch.int64), min_p=dev(min_p[sel], torch.float32),
                   draw_seeds=dev(draw_seed[sel], torch.int64),
                   rows=None if all_rows else dev(sampled, torch.int64),
                   sort=dev(sort, torch.int64), has_sort=len(sort) > 0,
                   any_min_p=bool((min_p[sel] > 0).any()), any_sampled=len(sampled) > 0)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), in int64 without overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a 32-bit hash, in int64 lanes."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def race_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """log E, E ~ Exp(1), [len(seeds), vocab]: row i a pure function of seeds[i] (the native op's hash, exactly;
    its log is torch's). v = (hash24 + 1) / 2^24 in (0, 1]; E = -log v is kept >= the smallest normal float:
    E == 0 (v == 1) would make log E = -inf and a masked token's score -inf + inf = NaN, which argmax picks."""
    j = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    k0, k1 = (seeds & _M32)[:, None], ((seeds >> 32) & _M32)[:, None]
    x = _mix(_mix((j * 0x9E3779B9 + k0) & _M32) ^ k1)
    v = ((x >> 8) + 1).to(torch.float32) * 2.0 ** -24
    return v.log().neg_().clamp_min_(torch.finfo(torch.float32).tiny).log_()


# Of each byte value: the int32 AND mask (-1: keep) of its 8 tokens, bit i of the byte being token i.
_KEEP_BYTE = torch.tensor([[-((b >> i) & 1) for i in range(8)] for b in range(256)], dtype=torch.int32)
_NEG_INF_BITS = -8388608                  # 0xFF800000: float32 -inf as an int32


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The grammar branch: forbid (-inf) every token a row's grammar does not allow, in place.

    logits: [B, V]; rows: [G] batch rows under a grammar; bitmask: [G, ceil(V/32)] int32, bit t of a row set
    when token t is allowed (llguidance's layout). A forbidden logit's bits become -inf's (masked_fill, on the
    int32 view: one table lookup per byte of the mask and two integer passes; at 262k tokens and 8 rows
    ~5x less than expanding the bits and masked_fill). Byte j of a little-endian word holds its bits 8j..8j+7."""
    vocab = logits.shape[-1]
    table = _KEEP_BYTE if logits.device.type == "cpu" else _KEEP_BYTE.to(logits.device)
    keep = table.index_select(0, bitmask.contiguous().view(torch.uint8).reshape(-1).long())   # [G * 4W, 8]
    keep = keep.view(len(rows), -1)[:, :vocab]                                                # [G, V] -1 / 0
    whole = len(rows) == logits.shape[0] and logits.is_contiguous()
    sub = logits if whole else logits[rows]
    bits = sub.view(torch.int32)
    bits.bitwise_and_(keep).bitwise_or_(keep.bitwise_not().bitwise_and_(_NEG_INF_BITS))
    if not whole:
        logits[rows] = sub


def apply_token_bitmask_reference(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_token_bitmask's definition: the bits expanded, masked_fill."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]   # [G, V]
    logits[rows] = logits[rows].masked_fill(~allowed, -math.inf)


def race_argmax(x: torch.Tensor, t: torch.Tensor | None, seeds: torch.Tensor | None, native: bool) -> torch.Tensor:
    """argmax_j (x[i, j] / t[i] - log E[i, j]) of each row, E from race_noise(seeds) (t None: no divide; seeds
    None: no noise), the first index on a tie. native: tandem's CPU op; this torch code is its reference."""
    if native:
        return torch.ops.tandem.race_argmax(x, t, seeds)
    v = x if t is None else x / t[:, None]
    return (v if seeds is None else v - race_noise(seeds, x.shape[-1])).argmax(dim=-1)


def sample(logits: torch.Tensor, p: SamplingBatch, native: bool = False) -> torch.Tensor:
    """logits: [B, V] fp32 (grammar rows already masked). Returns token ids [B] (int64). native: run the race
    and argmax with tandem's CPU op (the caller checked it is loaded and the logits are on the CPU)."""
    tokens = None
    if not p.any_sampled or p.rows is not None:
        tokens = race_argmax(logits, None, None, native)            # greedy rows
    if not p.any_sampled:
        return tokens
    x = logits if p.rows is None else logits[p.rows]                # [b, V]
    t: torch.Tensor | None = p.temperature
    if p.any_min_p or p.has_sort:
        z = x / t[:, None]
        z = z - z.max(dim=-1, keepdim=True).values                  # log of p / p_max
        if p.any_min_p:
            # p < min_p * p_max  <=>  z < log(min_p)
            z = z.masked_fill(z < torch.log(p.min_p.clamp_min(1e-30))[:, None], -math.inf)
        if p.has_sort:
            z[p.sort] = _top_k_top_p(z[p.sort], p.top_k[p.sort], p.top_p[p.sort])
        x, t = z, None
    choice = race_argmax(x, t, p.draw_seeds, native)
    return choice if p.rows is None else tokens.index_copy(0, p.rows, choice)


MAX_LOGPROBS = 20      # top logprobs a token may return (OpenAI's limit)
MAX_BIASES = 1024      # logit biases a row carries per step: logit_bias entries + tokens min_tokens forbids


@dataclass
class Logprobs:
    """Of the distribution each row sampled from: logits after the grammar mask and temperature (raw logits
    for greedy rows), before top-k / top-p / min-p truncation, as vLLM returns them."""
    chosen: torch.Tensor          # [B] log p of the sampled token
    top_ids: torch.Tensor         # [B, K] the K most likely tokens (K = the largest number a row asked for)
    top: torch.Tensor             # [B, K] their log p


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs:
    """Of the raw logits (no temperature, as vLLM's prompt logprobs): logits [N, V] at prompt positions,
    targets [N] the prompt ids that followed them."""
    lp = torch.log_softmax(logits, dim=-1)
    top, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], targets[:, None][:, :0])
    return Logprobs(lp.gather(1, targets[:, None]).squeeze(1), top_ids, top)


def logprobs(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor, k: int) -> Logprobs:
    """logits: [B, V]; temperature: [B] (0: greedy, taken as 1); tokens: [B]; k: top logprobs to keep."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    lp = torch.log_softmax(logits / t[:, None], dim=-1)
    top, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return Logprobs(lp.gather(1, tokens[:, None]).squeeze(1), top_ids, top)


TOP_CANDIDATES = 1024   # top-k / top-p first look for their cut among this many best tokens
_BIN = 8                # the mass histogram of a deeper cut: bins 1/8 wide in z = log(p / p_max)
_BINS = 512             # z in (-64, 0] (the last bin also takes everything below)
_SLACK = 1e-6           # float slack on "every token past the candidates is dropped" (cumsum rounding)


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) what top-k and top-p remove; the most likely token always survives. z: [b, V], max 0.

    Exactly _top_k_top_p_reference (one full stable sort), without sorting the vocabulary. Ranks follow z
    descending, ties by token id; a token is dropped when its rank is >= k or the mass ranked above it is >=
    top_p. Only ranks up to the cut need their order, and the cumsum that decides the cut is sequential, so
    over the true best n tokens in that order it is the reference's, bit for bit. Two stages:
    1. torch.topk of TOP_CANDIDATES (or k) tokens, enough for almost every row at a 49k vocabulary;
    2. a row whose cut lies further out (a flat distribution, top_p near 1: at 262k and temperature 1.5,
       top-p 0.9 keeps ~10k tokens and 0.99 ~90k) takes every token above a threshold read off a histogram
       of its mass, and sorts only those (an integer radix sort, z <= 0 as keys). A full sort of 262k logits
       was 609 ms for 8 rows; what is left is a few passes over the row and a sort of about the kept tokens.
    A candidate set decides a row when every token past it is dropped (all k ranks within it, or the mass
    above its last token >= top_p with _SLACK to spare) and, for topk's set (which orders ties arbitrarily
    and may hold part of the last tie group), no group of tied logits straddles the cut or its end (-inf
    ties aside: a masked token stays -inf kept or not). A row neither stage decides takes the reference.
    """
    vocab = z.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)
    n = min(vocab, max(TOP_CANDIDATES, int(k.max()) if bool((top_p >= 1).all()) else TOP_CANDIDATES))
    lse = torch.logsumexp(z, dim=-1, keepdim=True)                   # [b, 1]
    vals, idx = z.topk(n, dim=-1)                                     # [b, n] sorted, best first
    drop, above = _cut(vals, lse, k, top_p)
    tie = (vals[:, 1:] == vals[:, :-1]) & (vals[:, 1:] > -math.inf)  # -inf tokens stay -inf kept or dropped
    split = (tie & (drop[:, 1:] != drop[:, :-1])).any(dim=-1)         # a tie group straddles the cut
    rest_masked = vals[:, -1] == -math.inf                            # every finite token is a candidate
    exact = ((n == vocab) | (k < n) | (above[:, -1] >= top_p + _SLACK) | rest_masked) & ~split
    out = torch.full_like(z, -math.inf).scatter_(1, idx, vals.masked_fill(drop, -math.inf))
    if not bool(exact.all()):
        rest = (~exact).nonzero().squeeze(1)
        kr, pr, lr = k[rest], top_p[rest], lse[rest]
        k_value = vals[rest].gather(1, (kr - 1).clamp_max(n - 1)[:, None]).squeeze(1)   # z of rank k-1
        k_value = torch.where(kr <= n, k_value, -math.inf)
        part, decided = _threshold_cut(z[rest], lr, kr, pr, _mass_floor(z[rest], lr, pr, k_value))
        if not bool(decided.all()):
            u = (~decided).nonzero().squeeze(1)
            part[u] = _top_k_top_p_reference(z[rest[u]], kr[u], pr[u])
        out[rest] = part
    return out


def _cut(sorted_z: torch.Tensor, lse: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor):
    """The reference rule over the best n tokens in rank order: sorted_z [b, n], lse [b, 1] (of the whole
    row), k, top_p [b]. Returns (drop [b, n], mass ranked above each [b, n])."""
    probs = (sorted_z - lse).exp()                                    # true probabilities
    above = probs.cumsum(dim=-1) - probs                              # mass ranked strictly above each token
    ranks = torch.arange(sorted_z.shape[-1], device=sorted_z.device)
    drop = (ranks[None, :] >= k[:, None]) | (above >= top_p[:, None])
    drop[:, 0] = False
    return drop, above


def _mass_floor(z: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor, k_value: torch.Tensor) -> torch.Tensor:
    """[r] a z threshold per row: the tokens above it hold top_p of the mass with a bin to spare (a histogram
    of the mass in bins 1/_BIN wide; -inf: none short of the whole row), or the k-th value when that is
    higher (those tokens already hold every rank top-k keeps)."""
    bins = (z * -_BIN).clamp_(max=_BINS - 1).long()                   # floor(-z * _BIN): exact, _BIN a power of 2
    mass = z.new_zeros(z.shape[0], _BINS).scatter_add_(1, bins, (z - lse).exp())                   # [r, _BINS]
    first = (mass.cumsum(dim=-1) < (top_p[:, None] + 2 * _SLACK)).sum(dim=-1) + 1     # the bin it reaches, + 1
    floor = torch.where(first < _BINS - 1, -(first + 1).to(z.dtype) / _BIN, -math.inf)  # bins 0..first: z > floor
    return torch.maximum(floor, torch.nextafter(k_value, torch.full_like(k_value, -math.inf)))   # z >= k_value


def _threshold_cut(z: torch.Tensor, lse: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                   floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference rule over the tokens of each row [r, V] with z > floor[r]: all tokens of a tie, so their
    rank order is the reference's. One stable integer sort for all rows: key (row, |z|), |z| ascending being
    z descending for z <= 0, so the keys' bits are the float's (a radix sort on the CPU). Returns the masked
    rows and whether those tokens decide each row (every token left out is dropped, or -inf)."""
    r, vocab = z.shape
    rows, cols = (z > floor[:, None]).nonzero(as_tuple=True)          # [m] row-major
    vals = z[rows, cols]
    key = (rows << 31) | (vals.view(torch.int32).to(torch.int64) & 0x7FFFFFFF)
    order = key.sort(stable=True).indices                              # rows stay grouped, ties by token id
    rows, cols, vals = rows[order], cols[order], vals[order]
    counts = torch.bincount(rows, minlength=r)                         # [r] candidates of each row (>= 1)
    rank = torch.arange(len(rows), device=z.device) - (counts.cumsum(0) - counts)[rows]
    ranked = torch.full((r, int(counts.max())), -math.inf, device=z.device, dtype=z.dtype)   # [r, max m]
    ranked[rows, rank] = vals                                          # -inf padding: probability 0
    drop, above = _cut(ranked, lse, k, top_p)
    last = above.gather(1, (counts - 1)[:, None]).squeeze(1)
    decided = (floor == -math.inf) | (k <= counts) | (last >= top_p + _SLACK)
    out = torch.full_like(z, -math.inf)
    out[rows, cols] = vals.masked_fill(drop[rows, rank], -math.inf)
    return out, decided


def _top_k_top_p_reference(z: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition _top_k_top_p computes: one full stable sort. k: [b] in [1, V] (top-k off: V)."""
    sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
    drop, _ = _cut(sorted_z, torch.logsumexp(z, dim=-1, keepdim=True), k, top_p)
    return z.masked_fill(drop.scatter(1, order, drop), -math.inf)
