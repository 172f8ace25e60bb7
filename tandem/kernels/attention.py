"""Paged decode and extend attention (csrc/decode_attention.cpp, csrc/extend_attention.cpp) and their torch
references (gather, then SDPA; with sinks, transformers' gpt-oss softmax with the sink column: sink_attention).

sinks (every op): None, or fp32 [H], one learned logit per query head (gpt-oss) that joins every query's softmax
as one more key with no value: p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)). Not a key position: a
sliding window keeps it. The ops fold it into each head's final softmax state (csrc/attention_sink.h), so None
runs the ops as before, bit for bit, and causal_attention still gives a token its decode row's bits."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_quant import head_dim, to_cache, widen


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The ops' sinks argument: fp32 and contiguous (a bf16 checkpoint's parameter is widened exactly); as is when
    it already is (Attention keeps them so: no conversion a layer a step)."""
    if sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()):
        return sinks
    return sinks.detach().float().contiguous()


def decode_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], cache [S + 1, L, 2, KVH, D] (fp32, bf16 or fp16; or q8_0 blocks, kv_quant.py), kv_index [B, Lk],
    seq_lens [B] -> [B, H, D]; K/V read in place.
    window > 0 (a sliding-window layer): each row attends only its last `window` keys. sinks: see the top."""
    return torch.ops.tandem.decode_attention(q, cache, layer, kv_index, seq_lens, scale, -1, -1, window,
                                             sinks=_sinks(sinks))


def decode_attention_qkv_(qkv: torch.Tensor, cache: torch.Tensor, layer: int, out_cache_loc: torch.Tensor,
                          kv_index: torch.Tensor, seq_lens: torch.Tensor, scale: float, heads: int,
                          window: int = 0, bf16_products: bool = False,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention in one op: qkv [B, (H + 2 KVH) D] (after RoPE) -> [B, H D]. Row b's K and V
    are first written to cache slot out_cache_loc[b] of `layer`, then its query attends its seq_lens[b] keys
    (its last `window` of them when window > 0). bf16_products: scores and values on bf16 pairs (vdpbf16ps)
    where the op can (a bf16 cache, AVX512-BF16, head_dim % 32 == 0; elsewhere the fp32 products). sinks: see
    the top."""
    if sinks is not None:
        return torch.ops.tandem.decode_attention_qkv_(qkv, cache, layer, out_cache_loc, kv_index, seq_lens, scale,
                                                      heads, -1, -1, window, bf16_products, _sinks(sinks))
    if window or bf16_products:
        return torch.ops.tandem.decode_attention_qkv_(qkv, cache, layer, out_cache_loc, kv_index, seq_lens, scale,
                                                      heads, -1, -1, window, bf16_products)
    return torch.ops.tandem.decode_attention_qkv_(qkv, cache, layer, out_cache_loc, kv_index, seq_lens, scale, heads)


def decode_attention_qkv_ref(qkv: torch.Tensor, cache: torch.Tensor, layer: int, out_cache_loc: torch.Tensor,
                             kv_index: torch.Tensor, seq_lens: torch.Tensor, scale: float, heads: int,
                             window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    kvh, d = cache.shape[3], head_dim(cache)
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    cache[out_cache_loc, layer, 0] = to_cache(k.reshape(-1, kvh, d), cache)   # rounded as the cache holds it
    cache[out_cache_loc, layer, 1] = to_cache(v.reshape(-1, kvh, d), cache)
    out = decode_attention_ref(q.reshape(-1, heads, d), cache, layer, kv_index, seq_lens, scale, window, sinks)
    return out.reshape(qkv.shape[0], -1)                               # [B, H D]


def sink_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """SDPA with attention sinks, transformers' gpt-oss eager formula: queries [B, H, Lq, D], keys / values
    [B, KVH, Lk, D], mask [B, 1, Lq, Lk] bool (True = attend), sinks [H] -> [B, H, Lq, D]. The sink is one more
    logit column of each row's softmax, dropped before the values."""
    g = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    logits = (queries @ keys.transpose(2, 3) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(values.dtype) @ values


def decode_attention_ref(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, window: int = 0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    keys = widen(cache[kv_index, layer, 0], q.dtype).transpose(1, 2)     # [B, KVH, Lk, D], widened from the cache's
    values = widen(cache[kv_index, layer, 1], q.dtype).transpose(1, 2)
    k_pos = torch.arange(kv_index.shape[1])[None, :]
    valid = k_pos < seq_lens[:, None]                                 # [B, Lk]
    if window:
        valid &= k_pos >= seq_lens[:, None] - window
    if sinks is not None:
        return sink_attention(q.unsqueeze(2), keys, values, valid[:, None, None, :], scale, sinks).squeeze(2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)                                              # [B, H, D]


def extend_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor, tok_row: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int = 0, bf16_products: bool = False,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A step's new tokens, q [T, H, D] (rows may be strided), each attending its row's keys up to its own
    position, read in place: token t sees kv_index[tok_row[t], :positions[t] + 1] (its last `window` of them
    when window > 0) -> [T, H D]. Their K/V must be in the cache already (StepKV.write). bf16_products: on a
    bf16 cache where the CPU has AVX512-BF16 (and head_dim % 16 == 0), the queries (times scale) and the
    probabilities are rounded to bf16 for the products (vdpbf16ps), sums fp32; elsewhere the fp32 body runs.
    sinks: see the top."""
    return torch.ops.tandem.extend_attention(q, cache, layer, kv_index, tok_row, positions, scale, window, -1,
                                             bf16_products, sinks=_sinks(sinks))


def causal_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor, tok_row: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int = 0, bf16_products: bool = False,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """extend_attention's function (same arguments, K/V already in the cache) with each token's output the bits
    decode_attention gives it as a decode row over its own causal keys (csrc/causal_attention.cpp): the same
    whatever chunk, step or batch the token comes in (with sinks too). bf16_products: as decode_attention's."""
    return torch.ops.tandem.causal_attention(q, cache, layer, kv_index, tok_row, positions, scale, window, -1,
                                             bf16_products, sinks=_sinks(sinks))


def extend_attention_ref(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor,
                         tok_row: torch.Tensor, positions: torch.Tensor, scale: float, window: int = 0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: every token is a decode row over its own causal keys."""
    out = decode_attention_ref(q, cache, layer, kv_index[tok_row], positions + 1, scale, window, sinks)
    return out.reshape(q.shape[0], -1)
