"""The paged KV cache on the device, the per-step view attention reads through (StepKV), and the step's
attention layout over it (AttentionMeta, built once a step by the model_runner, read by every layer).

Layout: one tensor [num_slots + 1, layers, 2 (K, V), KVH, D]. A slot holds every layer's K and V of one token,
so a step gathers its rows' keys for a group of layers in one index_select of large rows, instead of one
small-row gather per layer and per K/V (measured here: ~14x less time for SmolLM2 at batch 64). The extra slot
`pad_slot` stays zero: key positions past a row's length gather from it, so masked keys never bring in
garbage (NaN * 0 is NaN).

Element type: `kv_cache_dtype` (fp32, bf16 or fp16; bf16 by default with the native int8 kernels; or q8_0,
llama.cpp's 8-bit blocks, held as uint8 [.., KVH, D / 32 * 34]: kernels/kv_quant.py). Every K and V is rounded
to it when written, by torch's conversion (or kv_quant.quantize) here and by the same rounding in the native
ops, and every reader widens it to the compute dtype: a key is the same bits whichever path wrote it and
whichever step reads it (so a prefix-cache hit reads what a fresh prefill would have).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.kv_quant import Q8_0, row_bytes, to_cache, widen

if TYPE_CHECKING:
    from .cascade import SharedPrefix
    from .linear_attention import RecurrentRows

GATHER_BUDGET_BYTES = 256 << 20     # cap on the per-step gather buffer; layers are gathered in groups below it


def kv_row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one head's K (or V) row of one token in a cache of `dtype` (Q8_0: q8_0 blocks)."""
    return row_bytes(head_dim) if dtype == Q8_0 else head_dim * dtype.itemsize


class PagedKVCache:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.num_layers = num_layers
        # Left uninitialized: a fast start, and pages never touched cost no memory. Every position a step
        # attends to below its length was written by that step or an earlier one.
        row = row_bytes(head_dim) if dtype == Q8_0 else head_dim                # a head's row in elements
        self.data = torch.empty(num_slots + 1, num_layers, 2, num_kv_heads, row, dtype=dtype, device=device)
        self.data[self.pad_slot].zero_()
        self._bufs: dict[int, torch.Tensor] = {}
        self._nested_bufs: dict[int, torch.Tensor] = {}

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a slot's KV lives in (the disk tier copies a slot's rows of each)."""
        return [self.data]

    @contextlib.contextmanager
    def nested(self):
        """A step run between two layers of another (the urgent-step branch, process/main.py) gathers into
        buffers of its own: the other's view of its current layer group stays in the usual ones."""
        outer, self._bufs = self._bufs, self._nested_bufs
        try:
            yield
        finally:
            self._nested_bufs, self._bufs = self._bufs, outer

    def step_view(self, kv_index: torch.Tensor, tok_row: torch.Tensor, positions: torch.Tensor,
                  out_cache_loc: torch.Tensor, has_prefix: bool, part: int = 0) -> "StepKV":
        """`part`: the group of a mixed step; each group gathers into its own buffer (their layer groups
        are interleaved, so a shared buffer would be overwritten under the other's view)."""
        return StepKV(self, kv_index, tok_row, positions, out_cache_loc, has_prefix, part)

    def buffer(self, numel: int, part: int = 0) -> torch.Tensor:
        """A reused gather buffer (always finite: zero-initialized, then only K/V values written).

        It grows geometrically: decode lengthens every row by one token a step, and a buffer re-made (and
        zeroed, and page-faulted) at every step cost a first run ~20 % of its throughput here."""
        buf = self._bufs.get(part)
        if buf is None or buf.numel() < numel:
            old = 0 if buf is None else buf.numel()
            size = max(numel, min(2 * old, GATHER_BUDGET_BYTES // self.data.element_size()))
            buf = self._bufs[part] = torch.zeros(size, dtype=self.data.dtype, device=self.data.device)
        return buf[:numel]


class StepKV:
    """One step's keys and values per layer: [B, KVH, Lk, D] views into a gathered buffer."""

    def __init__(self, cache: PagedKVCache, kv_index: torch.Tensor, tok_row: torch.Tensor,
                 positions: torch.Tensor, out_cache_loc: torch.Tensor, has_prefix: bool, part: int = 0) -> None:
        self.cache, self.part = cache, part
        self.kv_index = kv_index                 # [B, Lk] slot of each key position (pad_slot past the length)
        self.tok_row, self.positions = tok_row, positions    # [T] where each new token sits in [B, Lk]
        self.out_cache_loc = out_cache_loc       # [T]
        self._seq_lens: torch.Tensor | None = None  # [T] keys each new token attends (positions + 1), made once
        self.tok_kv_index: torch.Tensor | None = None   # [T, Lk] kv_index of each new token's row, made once
        self.has_prefix = has_prefix             # False: every key is new this step, nothing to gather
        b, lk = kv_index.shape
        # Every row new and Lk long: the step's tokens, row after row, are the keys in order (no view needed).
        self.dense = not has_prefix and tok_row.shape[0] == b * lk
        per_layer = max(1, b * lk * cache.data.shape[2:].numel())   # (a pipeline stage of linear layers holds none)
        self.group = max(1, min(cache.num_layers, GATHER_BUDGET_BYTES // (per_layer * cache.data.element_size())))
        self._first = -1
        self._view: torch.Tensor | None = None   # [B, Lk, group, 2, KVH, D]

    def at(self, layer: int) -> tuple["StepKV", int]:
        """The view holding attention layer `layer`'s keys, and its index there (GroupedStepKV: its shape's)."""
        return self, layer

    @property
    def seq_lens(self) -> torch.Tensor:
        """[T] keys each new token attends: its position + 1 (a decode row's sequence length), once a step."""
        if self._seq_lens is None:
            self._seq_lens = self.positions + 1
        return self._seq_lens

    def _gather(self, layer: int) -> None:
        data = self.cache.data
        g = min(self.group, self.cache.num_layers - layer)
        b, lk = self.kv_index.shape
        shape = (b * lk, g) + tuple(data.shape[2:])
        buf = self.cache.buffer(b * lk * g * data[0, 0].numel(), self.part).view(shape)
        if self.has_prefix:
            torch.index_select(data[:, layer:layer + g], 0, self.kv_index.reshape(-1), out=buf)
        self._view = buf.view(b, lk, *shape[1:])
        self._first = layer

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new k, v ([T, KVH, D]) to the cache only (for readers that take every key in place
        through kv_index); returns them as the cache holds them."""
        data = self.cache.data
        if k.dtype != data.dtype:             # a bf16/fp16/q8_0 cache: round once, the same bits wherever read
            k, v = to_cache(k, data), to_cache(v, data)
        data[self.out_cache_loc, layer, 0] = k
        data[self.out_cache_loc, layer, 1] = v
        return k, v

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new k, v ([T, KVH, D]) to the cache and the view; return keys, values of the layer
        in `dtype` (default k's: the attention's; prefill_act="bf16" asks for bf16 while k, v are written from
        fp32, so the cache rounds them once, whatever its dtype)."""
        dtype = k.dtype if dtype is None else dtype
        k, v = self.write(layer, k, v)
        if self.dense:                        # the keys are k itself (rounded as the cache holds it)
            b, lk = self.kv_index.shape
            keys, values = k.view(b, lk, *k.shape[1:]), v.view(b, lk, *v.shape[1:])
            if keys.dtype != dtype:
                keys, values = widen(keys, dtype), widen(values, dtype)
            return keys.transpose(1, 2), values.transpose(1, 2)
        if self._view is None or layer >= self._first + self.group:
            self._gather(layer)
        g = layer - self._first
        self._view[self.tok_row, self.positions, g, 0] = k
        self._view[self.tok_row, self.positions, g, 1] = v
        keys, values = self._view[:, :, g, 0], self._view[:, :, g, 1]        # [B, Lk, KVH, D]
        if keys.dtype != dtype:               # attention computes in the step's dtype
            keys, values = widen(keys, dtype), widen(values, dtype)
        return keys.transpose(1, 2), values.transpose(1, 2)   # [B, KVH, Lk, D], strided: SDPA reads it as is


class GroupedKVCache:
    """Attention layers of more than one KV shape (gemma4: full layers with their own head dim and KV heads) as one
    PagedKVCache a shape, every one over the same slot ids: a token's slot holds its K/V in each. where[i]: attention
    layer i's (cache, index in it). One cache of the widest shape would hold the narrower layers padded (Gemma 4
    26B-A4B: full layers' 2 x 512 in sliding layers' 8 x 256, 1.9x their bytes; E2B: sliding layers' 256 in 512)."""

    def __init__(self, num_slots: int, shapes: list[tuple[int, int]], dtype: torch.dtype,
                 device: torch.device) -> None:
        kinds = list(dict.fromkeys(shapes))                     # (KV heads, head dim), in first-layer order
        counts = [shapes.count(k) for k in kinds]
        self.caches = [PagedKVCache(num_slots, n, kvh, d, dtype, device) for n, (kvh, d) in zip(counts, kinds)]
        self.where = [(kinds.index(k), shapes[:i].count(k)) for i, k in enumerate(shapes)]
        self.num_slots, self.pad_slot, self.num_layers = num_slots, num_slots, len(shapes)
        self.data = self.caches[0].data

    def tensors(self) -> list[torch.Tensor]:
        return [c.data for c in self.caches]

    @contextlib.contextmanager
    def nested(self):
        with contextlib.ExitStack() as stack:
            for cache in self.caches:
                stack.enter_context(cache.nested())
            yield

    def step_view(self, kv_index: torch.Tensor, tok_row: torch.Tensor, positions: torch.Tensor,
                  out_cache_loc: torch.Tensor, has_prefix: bool, part: int = 0) -> "GroupedStepKV":
        return GroupedStepKV([c.step_view(kv_index, tok_row, positions, out_cache_loc, has_prefix, part)
                              for c in self.caches], self.where)


class GroupedStepKV:
    """One step's view of a GroupedKVCache: a StepKV a shape; at(i) picks layer i's. The step's layout (kv_index,
    positions, ...) is the first view's: every view has the same."""

    def __init__(self, views: list[StepKV], where: list[tuple[int, int]]) -> None:
        self.views, self.where = views, where

    def at(self, layer: int) -> tuple[StepKV, int]:
        g, j = self.where[layer]
        return self.views[g], j

    def __getattr__(self, name: str):
        return getattr(self.views[0], name)


@dataclass
class AttentionMeta:
    """Per-step attention layout, built once and shared by every layer.

    B rows (requests), T new tokens in all, Lq = longest extend, Lk = longest sequence.
    """
    kv: "StepKV | GroupedStepKV"  # the step's view of the paged KV cache
    mask: torch.Tensor            # [B, 1, Lq, Lk] bool, True = attend
    q_index: torch.Tensor | None  # [B, Lq] flat token of each query slot (None: pure decode, Lq == 1)
    token_rc: tuple[torch.Tensor, torch.Tensor] | None  # (row, col) of each flat token in the [B, Lq] layout
    last_index: torch.Tensor      # [B] flat index of each row's last token (the one that samples)
    parts: list[tuple[slice, "AttentionMeta"]] | None = None   # mixed step: (its tokens, its layout) per group
    window_masks: dict | None = None  # sliding window W -> its mask, made once a step by window_mask()
    fresh: list[int] | None = None    # each row's length when no row has cached keys (plain causal attention)
    # Rows on one cached prefix (model/cascade.py): its slots; kv, mask (then additive float) and positions
    # cover only the keys after it.
    shared: "SharedPrefix | None" = None
    recurrent: "RecurrentRows | None" = None   # a hybrid model's rows' state slots (linear_attention.py)
    @property
    def decode_only(self) -> bool:
        """One token a row: the decode op (fused into the decode layer) serves them all."""
        return self.parts is None and self.q_index is None

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` narrowed to keys k > q - window of each query position q (a sliding-window layer), made once a
        step for all its layers. A padded query slot that would see no key keeps its `mask` row (its output is
        dropped; an empty row would be NaN)."""
        if self.window_masks is None:
            self.window_masks = {}
        m = self.window_masks.get(window)
        if m is None:
            kv = self.kv
            q_pos = kv.positions[:, None] if self.q_index is None else kv.positions[self.q_index]   # [B, Lq]
            k_pos = torch.arange(self.mask.shape[-1], device=q_pos.device)
            m = self.mask & (k_pos[None, None, :] > q_pos[:, :, None] - window)[:, None]     # [B, 1, Lq, Lk]
            m = torch.where(m.any(-1, keepdim=True), m, self.mask)
            self.window_masks[window] = m
        return m
