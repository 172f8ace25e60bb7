"""The device side of a step: owns weights, KV cache, request table (req_to_token) and FutureMap.

It runs inline (CUDA streams, or CPU synchronously) or inside the CPU device process; the code is the same.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ..model.kv_cache import PagedKVCache
from ..model.llama import AttentionMeta, LlamaModel
from ..model.loader import ModelSource, load_weights
from ..sampler import SamplingBatch, sample
from .future_map import FutureMap
from .step import StepInput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExecutorSpec:
    """Everything the device side needs to build itself; plain data, so it crosses a process boundary."""
    source: ModelSource           # plain data: config, weight files, tokenizer dir
    device: str
    dtype: str
    max_running: int
    max_model_len: int | None
    kv_cache_tokens: int | None
    kv_memory_fraction: float
    poison_future_map: bool = False
    kernels: str = "torch"        # "native": GGUF blocks stay quantized, tandem.kernels ops (CPU fp32 only)


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelExecutor:
    def __init__(self, spec: ExecutorSpec, state: dict[str, torch.Tensor] | None = None) -> None:
        self.spec = spec
        self.config = spec.source.config
        self.device = torch.device(spec.device)
        dtype = _DTYPES[spec.dtype]
        c = self.config
        from ..kernels import use_native
        native = use_native(spec.kernels, self.device, dtype)
        if state is None:
            state = load_weights(spec.source, quantized=native)
        bytes_per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.itemsize
        if spec.kv_cache_tokens is not None:
            num_slots = spec.kv_cache_tokens
        else:
            weight_bytes = sum(t.numel() for t in state.values()) * dtype.itemsize
            free = _free_memory_bytes(self.device) - (weight_bytes if self.device.type == "cuda" else 0)
            num_slots = max(256, min(int(free * spec.kv_memory_fraction) // bytes_per_slot, 1 << 20))
        max_context = c.max_position_embeddings if spec.max_model_len is None else spec.max_model_len
        self.max_context = min(max_context, num_slots)
        self.num_slots = num_slots
        self.model = LlamaModel(c, state, self.max_context, self.device, dtype, native=native)
        del state
        self.kv_cache = PagedKVCache(num_slots, c.num_layers, c.num_kv_heads, c.head_dim, dtype, self.device)
        # Request table: req_to_token[row, position] = KV slot. Row 0 is the padding row.
        self.req_to_token = torch.zeros(spec.max_running + 1, self.max_context, dtype=torch.int32,
                                        device=self.device)
        self.future_map = FutureMap(spec.max_running + 1, self.device, poison=spec.poison_future_map)

    def _tensor(self, a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(a).to(device=self.device, dtype=dtype, non_blocking=True)

    @torch.inference_mode()
    def run_step(self, step: StepInput) -> torch.Tensor:
        """Forward, sample and stash into the FutureMap. Returns the sampled ids [B] on the device."""
        dev = self.device
        rows = self._tensor(step.rows)
        ext = self._tensor(step.extend_lens)
        seq = self._tensor(step.seq_lens)
        if len(step.poison_rows):
            self.future_map.poison(self._tensor(step.poison_rows))
        b, t = step.batch_size, step.num_tokens
        tok_row = torch.repeat_interleave(torch.arange(b, device=dev), ext, output_size=t)  # [T]
        starts = torch.cumsum(ext, 0) - ext                                        # [B] flat start of each row
        tok_col = torch.arange(t, device=dev) - starts[tok_row]                    # [T] index within the row
        positions = (seq - ext)[tok_row] + tok_col                                 # [T]
        out_cache_loc = self._tensor(step.out_cache_loc)
        tok_req_row = rows[tok_row]
        self.req_to_token[tok_req_row, positions] = out_cache_loc.to(torch.int32)
        input_ids = self._tensor(step.input_ids)
        if step.use_future.any():
            # FutureMap read: decode input ids are the tokens the previous step sampled, gathered on the device.
            fut = self._tensor(step.use_future, torch.bool)[tok_row].nonzero().squeeze(1)
            input_ids[fut] = self.future_map.gather(tok_req_row[fut])
        meta = self._attention_meta(step, rows, ext, seq, starts, tok_row, positions, out_cache_loc, tok_col)
        logits = self.model.forward(input_ids, positions, meta)
        tokens = sample(logits, SamplingBatch.from_host(step.temperature, step.top_p, step.top_k, step.min_p,
                                                        step.draw_seed, dev))
        # FutureMap write: the next step of these rows reads its input ids from here.
        self.future_map.stash(rows, tokens)
        return tokens

    def _attention_meta(self, step: StepInput, rows, ext, seq, starts, tok_row, positions, out_cache_loc,
                        tok_col) -> AttentionMeta:
        dev = self.device
        lk = int(step.seq_lens.max())
        lq = int(step.extend_lens.max())
        k_pos = torch.arange(lk, device=dev)
        valid = k_pos[None, :] < seq[:, None]                                      # [B, Lk]
        kv_index = torch.where(valid, self.req_to_token[rows, :lk].long(), self.kv_cache.pad_slot)  # [B, Lk]
        has_prefix = bool((step.seq_lens > step.extend_lens).any())
        kv = self.kv_cache.step_view(kv_index, tok_row, positions, out_cache_loc, has_prefix)
        last_index = starts + ext - 1
        if lq == 1:
            return AttentionMeta(kv, valid[:, None, None, :], None, None, last_index)
        q_col = torch.arange(lq, device=dev)
        q_pos = (seq - ext)[:, None] + q_col[None, :]                              # [B, Lq]
        causal = k_pos[None, None, :] <= q_pos[:, :, None]                         # [B, Lq, Lk]
        # Padded query slots (col >= extend) see every valid key, so no row of the mask is empty.
        pad = (q_col[None, :] >= ext[:, None])[:, :, None]
        mask = (causal | pad) & valid[:, None, :]
        q_index = torch.where(q_col[None, :] < ext[:, None], starts[:, None] + q_col[None, :], 0)
        return AttentionMeta(kv, mask[:, None], q_index, (tok_row, tok_col), last_index)

