"""Paged decode attention (csrc/decode_attention.cpp) and its torch reference (gather, then SDPA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D], cache [S + 1, L, 2, KVH, D], kv_index [B, Lk], seq_lens [B] -> [B, H, D]; K/V read in place."""
    return torch.ops.tandem.decode_attention(q, cache, layer, kv_index, seq_lens, scale)


def decode_attention_ref(q: torch.Tensor, cache: torch.Tensor, layer: int, kv_index: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    keys = cache[kv_index, layer, 0].transpose(1, 2)                  # [B, KVH, Lk, D]
    values = cache[kv_index, layer, 1].transpose(1, 2)
    valid = torch.arange(kv_index.shape[1])[None, :] < seq_lens[:, None]    # [B, Lk]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)                                              # [B, H, D]
