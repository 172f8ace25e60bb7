"""Which attention a step's tokens take: the batch-invariance rule, stated and enforced here.

The rule (batch_invariant, the default of the native path): a token's attention is chosen by its role in its own
request, never by its step. A token at a prompt position (position < its request's prompt length: a chunk of any
size, a prompt's last token alone after a prefix-cache hit, a mixed step's prefill row) attends by the extend op
(csrc/extend_attention.cpp), whose key blocks sit at absolute positions and whose sums run in each token's own
lane (csrc/extend_attention_simd.inc), so a prompt token's bits do not depend on its chunk or its batch mates.
A generated token attends by the decode op's arithmetic: decode rows, verify rows and the overlap loop's riding
rows by the decode op (csrc/decode_attention.cpp), and generated tokens recomputed in a chunk (a retracted
request's outputs) by tandem.causal_attention, which gives each token the decode op's bits for its own causal
keys (csrc/causal_attention.inc). The two arithmetics differ, so KV made by one never stands in for the other:
the prefix cache keys generated tokens apart from prompt tokens (memory/kv_manager.py: KVCacheManager.key_ids),
and a prompt that holds an earlier answer recomputes it as a prompt, as it would on an empty cache. The step's
roles are marked once a step (device/attention_layout.py, from StepInput.prompt_lens). With the linears' own
invariant (kernels/quant.py: the int8 GEMV, packed GEMV and int8 GEMM give a row the same bits at any row count)
and per-row norms, RoPE, sampling and logprobs, a request's tokens and logprobs do not depend on its batch
mates, the step's size, how its prompt was chunked, whether its prefix came from the cache, retraction, the loop
or the device thread count (tests/scheduler/test_batch_invariance.py).
Without it (batch_invariant=False) a chunk of more than small_m() tokens attends by the extend op or, under
prefill_bf16 with AMX, by bf16 SDPA; shorter chunks by the decode op: a token's bits then follow the step's size
(and the prefix cache reuses any token's KV).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.attention import causal_attention, decode_attention_qkv_, extend_attention
from ..kernels.quant import small_m
from .cascade import cascade_attention
from .kv_cache import AttentionMeta


class Attention:
    """A model's attention entry point (LlamaModel.attention): picks the path per token by the rule above.

    native: tandem's ops (else torch SDPA on gathered keys). windows[i]: layer i's sliding window (0: global).
    extend_dtype: SDPA's and the cascade's dtype (bf16 under prefill_bf16). extend_bf16 / decode_bf16: the
    extend / decode (and causal) ops take bf16 products (ModelRunner.extend_bf16 / decode_bf16)."""

    def __init__(self, native: bool, scale: float, num_heads: int, windows: list[int], dtype: torch.dtype,
                 prefill_bf16: bool, extend_bf16: bool, decode_bf16: bool, batch_invariant: bool) -> None:
        self.native, self.scale, self.num_heads, self.windows = native, scale, num_heads, windows
        self.batch_invariant = bool(batch_invariant and native)
        # Attention of a long prefill chunk (SDPA, cascade) computes in this dtype (cascade masks are made in it)
        self.extend_dtype = torch.bfloat16 if prefill_bf16 else dtype
        # Long chunks attend natively (the causal or the extend op), but where prefill_bf16 has AMX tiles for
        # its bf16 SDPA the extend op gives way to it (not under batch_invariant: never bf16 prefill there)
        self.extend_native = native and (self.batch_invariant or not (prefill_bf16
                                                                       and torch.cpu._is_amx_tile_supported()))
        self.extend_bf16 = bool(extend_bf16 and self.extend_native)
        self.decode_bf16 = bool(decode_bf16 and native)

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMeta) -> torch.Tensor:
        """Layer i's attention of a step's tokens: q [T, H, D], k, v [T, KVH, D] -> [T, H D]."""
        if meta.parts is not None:      # a mixed step: decode rows and prefill rows attend in their own layouts
            return torch.cat([self(i, q[t], k[t], v[t], m) for t, m in meta.parts])
        if self.batch_invariant and meta.prompt_index is not None:     # prompt tokens: by the rule above
            return self._by_role(i, q, k, v, meta)
        if self.native and meta.q_index is None:        # a mixed step's decode part
            return self.decode(i, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), meta)
        if self.batch_invariant:        # generated tokens recomputed (a retracted request's): as decode rows
            return self._causal_attention(i, q, k, v, meta)
        if self.native and q.shape[0] <= small_m():     # a few new tokens: each attends as a decode row would
            return self._token_attention(i, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), meta)
        if self.extend_native:          # a long chunk: the native op reads every key in place
            return self._extend_attention(i, q, k, v, meta)
        out_dtype = q.dtype             # a long chunk under prefill_bf16 attends in bf16 (2-2.3x fp32 SDPA's rate)
        keys, values = meta.kv.store(i, k, v, self.extend_dtype)        # [B, KVH, Lk, D]
        q = q.to(self.extend_dtype)
        if meta.shared is not None:     # rows on one cached prefix: it once, their own keys after it
            queries = q[meta.q_index].transpose(1, 2)
            return cascade_attention(q, meta.shared.keys_values(meta.kv.cache.data, i, q.dtype), queries, keys,
                                     values, meta.mask, meta.token_rc, self.scale).to(out_dtype)
        if meta.q_index is None:
            queries = q.unsqueeze(2)                                    # [B, H, 1, D]
        else:
            queries = q[meta.q_index].transpose(1, 2)                   # [B, H, Lq, D]
        window = self.windows[i]
        if meta.fresh is not None and not window:
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
        """Extend rows of more than small_m() new tokens (batch_invariant: prompt tokens of any count), q [T, H, D]: the
        step's K/V written to the cache, then every token attends its row's keys through kv_index in place
        (csrc/extend_attention.cpp): no gathered, widened, padded copy and no mask. The cascade split is not needed
        here: the op widens a key block once for all of a task's query rows, and a shared prefix's keys stay in cache
        between rows. Measured on an AMD EPYC (AVX-512, no AMX), 2 threads, bf16 cache: 2.3-5x less time than the
        gather + SDPA it replaces (benchmarks/extend_attention.py); extend_bf16: bf16 products, 1.5-1.6x more.
        prefill_bf16 (CPUs with AMX) keeps its bf16 SDPA."""
        kv = meta.kv
        kv.write(i, k, v)
        return extend_attention(q, kv.cache.data, i, kv.kv_index, kv.tok_row, kv.positions, self.scale,
                                self.windows[i], bf16_products=self.extend_bf16)

    def _by_role(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMeta) -> torch.Tensor:
        """batch_invariant, rows holding prompt tokens (meta.prompt_index), q [T, H, D]: the step's K/V written
        to the cache, then the prompt tokens attend by the extend op (its key blocks at absolute positions, each
        token's sums its own: csrc/extend_attention_simd.inc) and any others (meta.generated_index) by the
        causal op, each the bits of its decode row. A one-token chunk takes the extend op as a long one does."""
        pi, gi = meta.prompt_index, meta.generated_index
        if gi is None:                  # every token a prompt's: the extend op over the whole step
            return self._extend_attention(i, q, k, v, meta)
        kv = meta.kv
        kv.write(i, k, v)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        out[pi] = extend_attention(q[pi], kv.cache.data, i, kv.kv_index, kv.tok_row[pi], kv.positions[pi],
                                   self.scale, self.windows[i], bf16_products=self.extend_bf16)
        out[gi] = causal_attention(q[gi], kv.cache.data, i, kv.kv_index, kv.tok_row[gi], kv.positions[gi],
                                   self.scale, self.windows[i], bf16_products=self.decode_bf16)
        return out

    def _causal_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: AttentionMeta) -> torch.Tensor:
        """Generated tokens recomputed in a chunk (batch_invariant: a retracted request's outputs), q [T, H, D]:
        the step's K/V written to the cache, then every token attends its row's keys up to its position with
        the decode op's arithmetic (csrc/causal_attention.inc): the bits it got as a decode row."""
        kv = meta.kv
        kv.write(i, k, v)
        return causal_attention(q, kv.cache.data, i, kv.kv_index, kv.tok_row, kv.positions, self.scale,
                                self.windows[i], bf16_products=self.decode_bf16)

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
        kv = meta.kv
        if kv.tok_kv_index is None:                     # once a step, not once a layer
            kv.tok_kv_index = kv.kv_index[kv.tok_row]                   # [T, Lk]
        return decode_attention_qkv_(qkv, kv.cache.data, i, kv.out_cache_loc, kv.tok_kv_index, kv.seq_lens,
                                     self.scale, self.num_heads, self.windows[i], self.decode_bf16)  # [T, H*D]

    def decode(self, i: int, qkv: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """Pure decode (one new token a row, T == B), qkv [B, (H + 2 KVH) D]: the native op writes the step's
        K/V at out_cache_loc, then reads every key in place through kv_index (no gathered copy). A row's token
        sits at position seq_len - 1."""
        kv = meta.kv
        return decode_attention_qkv_(qkv, kv.cache.data, i, kv.out_cache_loc, kv.kv_index, kv.seq_lens,
                                     self.scale, self.num_heads, self.windows[i], self.decode_bf16)  # [B, H*D]
