"""Which attention a step's tokens take: the batch-invariance rule, stated and enforced here.

The rule (batch_invariant, the default of the native path): every token attends with one arithmetic, the decode
op's, whatever its role, chunk or batch mates. Decode rows, verify rows and the overlap loop's riding rows attend
by the decode op (csrc/decode_attention.cpp); every token of a chunk (a prompt's, in any chunk size, or a
retracted request's outputs recomputed) by tandem.causal_attention, which gives each token the decode op's bits
for its own causal keys (csrc/causal_attention.cpp; in GEMM form, causal_gemm_simd.inc / causal_gemm_bf16.inc):
scores as four fma chains in one order, tiles and chunks at absolute key positions, chunk states folded in
order. So a token's KV is the same bits whichever path made it, and the prefix cache reuses any token's, an
earlier answer held in a later prompt included. With the linears' own invariant (kernels/quant.py: the int8
GEMV, packed GEMV and int8 GEMM give a row the same bits at any row count) and per-row norms, RoPE, sampling and
logprobs, a request's tokens and logprobs do not depend on its batch mates, the step's size, how its prompt was
chunked, whether its prefix came from the cache, retraction, the loop or the device thread count
(tests/scheduler/test_batch_invariance.py).
Without it (batch_invariant=False) a chunk of more than small_m() tokens attends by the extend op (csrc/
extend_attention.cpp, summed in another order) or, under prefill_bf16 with AMX, by bf16 SDPA; shorter chunks by
the decode op: a token's bits then follow the step's size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.attention import causal_attention, decode_attention_qkv_, extend_attention
from ..kernels.quant import small_m
from .cascade import cascade_attention, sdpa_sinks
from .kv_cache import AttentionMeta
from .numerics import Numerics


class Attention:
    """A model's attention entry point (LlamaModel.attention): picks the path per token by the rule above.

    The paths come from the numeric record (model/numerics.py), decided there: native: tandem's ops (else torch
    SDPA on gathered keys); extend_native: a long chunk attends by a native op (else SDPA: the torch path, or
    prefill_bf16's bf16 SDPA on AMX tiles); extend_dtype: SDPA's and the cascade's dtype (bf16 under
    prefill_bf16); extend_bf16 / decode_bf16: the extend / decode (and causal) ops take bf16 products.
    windows[i]: layer i's sliding window (0: global). sinks[i]: layer i's attention sinks (gpt-oss: fp32 [H], a
    logit per query head in every token's softmax, kernels/attention.py) or None; every path takes them, the rule
    above kept (the causal op folds them as the decode op does)."""

    def __init__(self, numerics: Numerics, scale: float, num_heads: int, windows: list[int],
                 sinks: list[torch.Tensor | None] | None = None) -> None:
        self.scale, self.num_heads, self.windows = scale, num_heads, windows
        self.sinks = [None if s is None else s.detach().float().contiguous() for s in sinks or [None] * len(windows)]
        n = numerics
        self.native, self.batch_invariant, self.extend_native = n.native, n.batch_invariant, n.extend_native
        self.extend_dtype = n.extend_dtype      # cascade masks are made in it too
        self.extend_bf16, self.decode_bf16 = n.extend_bf16, n.decode_bf16

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMeta) -> torch.Tensor:
        """Layer i's attention of a step's tokens: q [T, H, D], k, v [T, KVH, D] -> [T, H D]."""
        if meta.parts is not None:      # a mixed step: decode rows and prefill rows attend in their own layouts
            return torch.cat([self(i, q[t], k[t], v[t], m) for t, m in meta.parts])
        if self.native and meta.q_index is None:        # a mixed step's decode part
            return self.decode(i, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), meta)
        if self.batch_invariant:        # a chunk's tokens, by the rule above: each as its decode row
            return self._causal_attention(i, q, k, v, meta)
        if self.native and q.shape[0] <= small_m():     # a few new tokens: each attends as a decode row would
            return self._token_attention(i, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), meta)
        if self.extend_native:          # a long chunk: the native op reads every key in place
            return self._extend_attention(i, q, k, v, meta)
        out_dtype = q.dtype             # a long chunk under prefill_bf16 attends in bf16 (2-2.3x fp32 SDPA's rate)
        kv, j = meta.kv.at(i)
        keys, values = kv.store(j, k, v, self.extend_dtype)            # [B, KVH, Lk, D]
        q = q.to(self.extend_dtype)
        if meta.shared is not None:     # rows on one cached prefix: it once, their own keys after it
            queries = q[meta.q_index].transpose(1, 2)
            return cascade_attention(q, meta.shared.keys_values(kv.cache.data, j, q.dtype), queries, keys,
                                     values, meta.mask, meta.token_rc, self.scale, self.sinks[i]).to(out_dtype)
        if meta.q_index is None:
            queries = q.unsqueeze(2)                                    # [B, H, 1, D]
        else:
            queries = q[meta.q_index].transpose(1, 2)                   # [B, H, Lq, D]
        window, sinks = self.windows[i], self.sinks[i]
        if sinks is not None:           # the sink added to SDPA's output by its log-sum-exp
            out = sdpa_sinks(queries, keys, values, meta.window_mask(window) if window else meta.mask, self.scale,
                             sinks)
        elif meta.fresh is not None and not window:
            out = self._causal_rows(queries, keys, values, meta.fresh)
        else:
            mask = meta.window_mask(window) if window else meta.mask
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=True)
        out = out.transpose(1, 2).to(out_dtype)                         # [B, Lq, H, D]
        if meta.token_rc is None:
            return out.reshape(q.shape[0], -1)                          # [T, H*D]
        rows, cols = meta.token_rc
        return out[rows, cols].reshape(q.shape[0], -1)

    def _extend_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: AttentionMeta) -> torch.Tensor:
        """Extend rows of more than small_m() new tokens (without batch_invariant), q [T, H, D]: the
        step's K/V written to the cache, then every token attends its row's keys through kv_index in place
        (csrc/extend_attention.cpp): no gathered, widened, padded copy and no mask. The cascade split is not needed
        here: the op widens a key block once for all of a task's query rows, and a shared prefix's keys stay in cache
        between rows. Measured on an AMD EPYC (AVX-512, no AMX), 2 threads, bf16 cache: 2.3-5x less time than the
        gather + SDPA it replaces (benchmarks/extend_attention.py); extend_bf16: bf16 products, 1.5-1.6x more.
        prefill_bf16 (CPUs with AMX) keeps its bf16 SDPA."""
        kv, j = meta.kv.at(i)
        kv.write(j, k, v)
        return extend_attention(q, kv.cache.data, j, kv.kv_index, kv.tok_row, kv.positions, self.scale,
                                self.windows[i], bf16_products=self.extend_bf16, sinks=self.sinks[i])

    def _causal_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: AttentionMeta) -> torch.Tensor:
        """A chunk's tokens under batch_invariant (a prompt's, or a retracted request's outputs), q [T, H, D]:
        the step's K/V written to the cache, then every token attends its row's keys up to its position with
        the decode op's arithmetic (csrc/causal_attention.cpp): the bits it gets as a decode row."""
        kv, j = meta.kv.at(i)
        kv.write(j, k, v)
        return causal_attention(q, kv.cache.data, j, kv.kv_index, kv.tok_row, kv.positions, self.scale,
                                self.windows[i], bf16_products=self.decode_bf16, sinks=self.sinks[i])

    def _causal_rows(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     lens: list[int]) -> torch.Tensor:
        """Rows with no cached keys ([B, H, Lq, D] queries, Lq = Lk): each row's tokens attend their causal past
        only, which SDPA's is_causal computes without a mask and skips the blocks above the diagonal (1.4-1.6x
        less time than the explicit mask at 1,000 tokens here). Rows of unequal length go one at a time; their
        padded query slots are left unset (the caller reads only real tokens)."""
        sdpa = F.scaled_dot_product_attention
        if all(n == queries.shape[2] for n in lens):
            return sdpa(queries, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
        out = torch.empty_like(queries)
        for b, n in enumerate(lens):
            out[b:b + 1, :, :n] = sdpa(queries[b:b + 1, :, :n], keys[b:b + 1, :, :n], values[b:b + 1, :, :n],
                                       is_causal=True, scale=self.scale, enable_gqa=True)
        return out

    def _token_attention(self, i: int, qkv: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """Extend rows of up to small_m() new tokens, qkv [T, (H + 2 KVH) D]: every token is one query row of
        the decode op over its own causal keys (its row's kv_index, positions + 1 keys; the op writes all T
        tokens' K/V before any attends). Invariant kept here: a token's attention is then bit for bit the one
        a decode step computes for it (the op's split depends on a row's length only), and at these sizes
        the quantized linears treat every row alone, so a step's output per token is the same whether its
        prompt was prefilled fresh, partly served by the prefix cache, chunked, or scored in a verify step."""
        kv, j = meta.kv.at(i)
        if kv.tok_kv_index is None:                     # once a step, not once a layer
            kv.tok_kv_index = kv.kv_index[kv.tok_row]                   # [T, Lk]
        return decode_attention_qkv_(qkv, kv.cache.data, j, kv.out_cache_loc, kv.tok_kv_index, kv.seq_lens,
                                     self.scale, self.num_heads, self.windows[i], self.decode_bf16,
                                     self.sinks[i])                                                 # [T, H*D]

    def decode(self, i: int, qkv: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """Pure decode (one new token a row, T == B), qkv [B, (H + 2 KVH) D]: the native op writes the step's
        K/V at out_cache_loc, then reads every key in place through kv_index (no gathered copy). A row's token
        sits at position seq_len - 1."""
        kv, j = meta.kv.at(i)
        return decode_attention_qkv_(qkv, kv.cache.data, j, kv.out_cache_loc, kv.kv_index, kv.seq_lens,
                                     self.scale, self.num_heads, self.windows[i], self.decode_bf16,
                                     self.sinks[i])                                                 # [B, H*D]
