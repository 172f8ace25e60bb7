"""A step's attention layout (model/kv_cache.py: AttentionMeta), built once a step from its rows and shared by every
layer: the KV view, masks and query index of each group of rows.

AttentionLayouts is the ModelRunner's: it reads the runner's request table and KV cache (passed in) and never
writes them; the runner writes each step's slots into the table before asking for the step's layout.
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.quant import small_m
from ..model.cascade import SharedPrefix, additive, shared_prefix
from ..model.kv_cache import AttentionMeta, PagedKVCache
from .step import StepInput
from .step_layout import TokenLayout, row_groups, token_layout


class AttentionLayouts:
    """Builds each step's AttentionMeta. cascade: rows on one cached prefix attend it once (model/cascade.py),
    where the runner allows it (CPU, not the native extend op, no sliding window)."""

    def __init__(self, device: torch.device, req_to_token: torch.Tensor, kv_cache: PagedKVCache, model,
                 cascade: bool) -> None:
        self.device, self.req_to_token, self.kv_cache, self.model = device, req_to_token, kv_cache, model
        self.cascade = cascade

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device=self.device, dtype=torch.int64, non_blocking=True)

    def for_step(self, step: StepInput, rows, positions, out_cache_loc, lay: TokenLayout) -> AttentionMeta:
        """One attention layout for the step, or one per group of rows: a mixed step's leading one-token
        rows (decode) and its prefill rows; and decode rows split in two where one padded [B, Lk] layout
        would cost much more than two. Padded together, every decode row would carry a chunk's Lq query
        slots (x30 the attention work at 32 decode rows + a 256 chunk), or one 4k-token row's Lk keys
        (x15 the gather at 16 rows of ~250 tokens). The scheduler puts decode rows first, shortest first."""
        e, sl = step.extend_lens, step.seq_lens
        last_index = self._tensor(lay.last)                              # [B] flat index of each row's last token
        nd, groups = row_groups(e, sl)
        if len(groups) == 1:
            return self._group(sl, e, rows, positions, out_cache_loc, last_index, lay)
        parts = []
        for part, (lo, hi) in enumerate(groups):
            t0, t1 = (lo, hi) if hi <= nd else (nd, step.num_tokens)    # decode rows: token i is row i
            r = slice(lo, hi)
            lay_r = token_layout(e[r], sl[r])
            meta = self._group(sl[r], e[r], rows[r], positions[t0:t1], out_cache_loc[t0:t1], None, lay_r, part=part)
            parts.append((slice(t0, t1), meta))
        return AttentionMeta(None, None, None, None, last_index, parts)

    def _group(self, seq_np: np.ndarray, ext_np: np.ndarray, rows, positions, out_cache_loc, last_index,
               lay: TokenLayout, part: int = 0) -> AttentionMeta:
        """The layout of rows (a group of the step's, lay its token layout): the KV view, masks, query index."""
        dev = self.device
        t = len(positions)
        tok_row = self._tensor(lay.tok_row)                                        # [T]
        seq = self._tensor(seq_np)
        lk = int(seq_np.max())
        lq = int(ext_np.max())
        k_pos = torch.arange(lk, device=dev)
        valid = k_pos[None, :] < seq[:, None]                                      # [B, Lk]
        kv_index = torch.where(valid, self.req_to_token[rows, :lk].long(), self.kv_cache.pad_slot)  # [B, Lk]
        has_prefix = bool((seq_np > ext_np).any())
        # Shared-prefix (cascade) extend: rows on one cached prefix attend it once (model/cascade.py); the
        # step's view, mask and positions then cover only the keys after it. Only where the token path
        # (a few tokens, each as a decode row) is not taken, and never with sliding windows (their layers
        # need the whole layout).
        p = 0
        if lq > 1 and has_prefix and self.cascade and (not self.model.native or t > small_m()):
            p = shared_prefix(kv_index, seq_np - ext_np)
        kv = self.kv_cache.step_view(kv_index[:, p:], tok_row, positions - p if p else positions, out_cache_loc,
                                     bool((seq_np - ext_np > p).any()), part)
        if lq == 1:
            return AttentionMeta(kv, valid[:, None, None, :], None, None, last_index)
        ext, starts, tok_col = self._tensor(ext_np), self._tensor(lay.starts), self._tensor(lay.token_cols())
        q_col = torch.arange(lq, device=dev)
        q_pos = (seq - ext)[:, None] + q_col[None, :]                              # [B, Lq]
        causal = k_pos[None, None, :] <= q_pos[:, :, None]                         # [B, Lq, Lk]
        # Padded query slots (col >= extend) see every valid key, so no row of the mask is empty.
        pad = (q_col[None, :] >= ext[:, None])[:, :, None]
        mask = (causal | pad) & valid[:, None, :]
        q_index = torch.where(q_col[None, :] < ext[:, None], starts[:, None] + q_col[None, :], 0)
        if p:       # a padded slot still sees its row's first own key, so no row of the cut mask is empty
            dtype = self.model.attention.extend_dtype
            return AttentionMeta(kv, additive(mask[:, None, :, p:], dtype), q_index, (tok_row, tok_col),
                                 last_index, shared=SharedPrefix(kv_index[0, :p].clone()))
        return AttentionMeta(kv, mask[:, None], q_index, (tok_row, tok_col), last_index,
                             fresh=None if has_prefix else ext_np.tolist())
