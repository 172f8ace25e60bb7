"""Shared-prefix (cascade) attention for extend steps: rows of one step whose cached keys start with the same
KV slots (requests on one radix-tree prefix) attend that prefix as ONE attention of all their new tokens
against its keys, merged per token with each row's own rest by log-sum-exp (FlashInfer's cascade, Hydragen).

Why: the padded layout gathers and widens the prefix once per row and runs the masked attention per row;
32 rows of 24 tokens on a 900-token prefix gathered 32 copies of it. Here the prefix is read once a layer,
and its part needs no mask (every new token of every row sits after it).

Where: the torch path, and bf16 chunks on CPUs with AMX tiles (prefill_act="bf16"); the native fp32 path attends
by the extend op (csrc/extend_attention.cpp), which reads every key in place and needs no split.
The split is chosen by the model_runner (`shared_prefix`), the math is here; the suffix part is the ordinary
padded layout with the prefix's columns cut off. Outputs equal the one-attention path up to fp32 rounding
(the softmax is summed in two parts), not bit for bit: in the exact mode logprobs agree within 1e-4
(tests/model/test_cascade_extend.py); where the linears round activations to int8, such a difference can flip a
rounding and move a logprob as much as a prefix-cache hit does (~0.1 on SmolLM2 with random-token prompts,
measured). `shared_prefix_attention=False` turns it off. The decode op's sharing
(csrc/shared_prefix_attention.cpp) is the bit-exact one, for decode rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.kv_quant import widen

MIN_SHARED = 64      # shortest shared prefix worth the split (tokens); below it one attention is cheaper

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu   # returns (out, logsumexp) on CPU


@dataclass
class SharedPrefix:
    """The step's shared prefix: its KV slots, read once a layer."""
    slots: torch.Tensor           # [P] the slots every row's first P keys are

    def keys_values(self, data: torch.Tensor, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, KVH, P, D] keys and values of `layer`, widened to the step's dtype (exact for bf16/fp16/q8_0)."""
        kv = widen(data[self.slots, layer], dtype)             # [P, 2, KVH, D]
        return kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]


def shared_prefix(kv_index: torch.Tensor, cached: np.ndarray) -> int:
    """Length P of the slots every row's keys start with, within every row's cached part (so each new token
    comes after all of them); 0 when below MIN_SHARED or fewer than two rows."""
    limit = int(cached.min()) if len(cached) > 1 else 0
    if limit < MIN_SHARED:
        return 0
    same = (kv_index[:, :limit] == kv_index[:1, :limit]).all(0)        # [limit]
    p = limit if bool(same.all()) else int(torch.argmin(same.to(torch.uint8)))
    return p if p >= MIN_SHARED else 0


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as the additive float mask the flash op takes."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def sdpa_sinks(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
               sinks: torch.Tensor) -> torch.Tensor:
    """SDPA with attention sinks (gpt-oss; kernels/attention.py), queries [B, H, Lq, D], keys / values
    [B, KVH, Lk, D], mask [B, 1, Lq, Lk] bool -> [B, H, Lq, D]: the flash op's output and log-sum-exp, the sink
    added after the fact: a sink sigma takes exp(sigma) of the softmax's mass, so out = o sigmoid(lse - sigma)."""
    o, lse = _flash(queries, keys, values, 0.0, False, attn_mask=additive(mask, queries.dtype), scale=scale)
    keep = torch.sigmoid(lse.float() - sinks.float()[None, :, None])         # [B, H, Lq]
    return (o.float() * keep[..., None]).to(o.dtype)


def cascade_attention(q: torch.Tensor, prefix_kv: tuple[torch.Tensor, torch.Tensor], queries: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      token_rc: tuple[torch.Tensor, torch.Tensor], scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] the step's new tokens; prefix_kv [1, KVH, P, D] each; queries [B, H, Lq, D], keys / values
    [B, KVH, Ls, D] and the additive mask [B, 1, Lq, Ls] of the rows' own keys after the prefix; token_rc maps
    flat tokens to (row, col); sinks [H] (gpt-oss) or None: a third part of log-sum-exp sigma and no output.
    Returns [T, H * D]."""
    o1, l1 = _flash(q.transpose(0, 1)[None], prefix_kv[0], prefix_kv[1], 0.0, False, scale=scale)
    o1, l1 = o1[0].transpose(0, 1), l1[0].transpose(0, 1)               # [T, H, D], [T, H]
    o2, l2 = _flash(queries, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    rows, cols = token_rc
    o2, l2 = o2.transpose(1, 2)[rows, cols], l2.transpose(1, 2)[rows, cols]   # [T, H, D], [T, H]
    m = torch.maximum(l1, l2)
    if sinks is not None:
        sink = sinks.float().expand_as(l1)
        m = torch.maximum(m, sink)
    w1, w2 = (l1 - m).exp_(), (l2 - m).exp_()                            # each part's share of the softmax
    total = w1 + w2 if sinks is None else w1 + w2 + (sink - m).exp_()
    out = (o1 * w1[..., None]).add_(o2 * w2[..., None]).div_(total[..., None])
    return out.reshape(q.shape[0], -1)
