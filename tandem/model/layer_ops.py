"""The two op sets the decoder layer body (llama.py: LlamaModel._layers) runs on, step for step: TorchOps, torch
op by op (kernels="torch", the reference), and NativeOps, tandem's fused ops in place (kernels="native"). The body
calls the same steps on either (norm, add_norm, heads, qk_norm, rope, split, gated), so it is written once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .rope import apply_rope


class Shapes(Protocol):
    """What the ops read of the model: its config (LlamaModel)."""
    config: ModelConfig


@dataclass(frozen=True)
class HeadShape:
    """An attention layer's heads on this rank: gemma4's full layers have their own head dim and KV heads, every
    other model one shape for all layers. kv_rows: the fused projection's K and V heads (0: a KV-shared layer's q
    only)."""
    heads: int
    kv_heads: int
    head_dim: int
    kv_rows: bool = True

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def turned(self) -> int:
        """Heads RoPE turns in the fused rows: q's, and k's where the rows hold them."""
        return self.heads + (self.kv_heads if self.kv_rows else 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim (weight already holds ModelConfig.norm_offset)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def split_heads(s: HeadShape, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused q/k/v projection [T, (H + 2 KVH) D] as views q [T, H, D], k, v [T, KVH, D]."""
    d = s.head_dim
    q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
    return q.view(-1, s.heads, d), k.view(-1, s.kv_heads, d), v.view(-1, s.kv_heads, d)


class TorchOps:
    """The steps of the layer body (LlamaModel._layers) in torch (kernels="torch"), op by op: q/k/v go as three
    views (heads), each normed and rotated out of place; RoPE's cos/sin at the step's positions are gathered once
    a table."""

    def __init__(self, model: Shapes, positions: torch.Tensor) -> None:
        self.model, self.positions, self.eps, self.tables = model, positions, model.config.rms_norm_eps, {}

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        """(x + delta, its norm): the residual stream with the sublayer's output added, and the next input."""
        x = x if delta is None else x + delta
        return x, rms_norm(x, weight, self.eps)

    def heads(self, qkv: torch.Tensor, s: HeadShape) -> tuple:
        if not s.kv_rows:               # a KV-shared layer's rows: q only
            return qkv.view(-1, s.heads, s.head_dim), None, None
        return split_heads(s, qkv)

    def qk_norm(self, qkv: tuple, weight: torch.Tensor, s: HeadShape) -> tuple:
        """q heads by weight's first H rows (q_norm), k heads by the next KVH (k_norm), and v heads by the last KVH
        where weight has them (gemma4's v_norm: ones)."""
        (q, k, v), h = qkv, s.heads
        q = rms_norm(q, weight[:h], self.eps)
        if k is None:
            return q, k, v
        if weight.shape[0] > h + s.kv_heads:
            v = rms_norm(v, weight[h + s.kv_heads:], self.eps)
        return q, rms_norm(k, weight[h:h + s.kv_heads], self.eps), v

    def rope(self, qkv: tuple, cos_t: torch.Tensor, sin_t: torch.Tensor, s: HeadShape) -> tuple:
        if id(cos_t) not in self.tables:
            self.tables[id(cos_t)] = (cos_t[self.positions].unsqueeze(1), sin_t[self.positions].unsqueeze(1))
        (q, k, v), (cos, sin) = qkv, self.tables[id(cos_t)]            # [T, 1, D]
        return apply_rope(q, cos, sin), None if k is None else apply_rope(k, cos, sin), v

    def split(self, qkv: tuple, s: HeadShape) -> tuple:
        return qkv

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the gate/up projection [T, 2I] -> [T, I] (SiLU, or gemma's tanh GELU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if self.model.config.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return act * up


class NativeOps:
    """The layer body's steps with tandem's fused ops (kernels="native"): residual add + RMSNorm in one pass (x
    updated in place), q/k/v kept fused [T, (H + 2 KVH) D] with QK-norm and RoPE in place on it, act(gate) x up
    in one op."""

    def __init__(self, model: Shapes, positions: torch.Tensor) -> None:
        self.model, self.positions, self.eps = model, positions, model.config.rms_norm_eps

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.tandem.rms_norm(x, weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor):
        if delta is None:
            return x, torch.ops.tandem.rms_norm(x, weight, self.eps)
        return x, torch.ops.tandem.add_rms_norm_(x, delta, weight, self.eps)     # x += delta in place

    def heads(self, qkv: torch.Tensor, s: HeadShape) -> torch.Tensor:
        return qkv                      # fused until the attention: a pure decode step's op takes it so

    def qk_norm(self, qkv: torch.Tensor, weight: torch.Tensor, s: HeadShape) -> torch.Tensor:
        """The op norms the first weight.shape[0] heads: q's, k's, and v's where weight holds v_norm's ones."""
        torch.ops.tandem.head_rms_norm_(qkv, weight, self.eps)
        return qkv

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, s: HeadShape) -> torch.Tensor:
        if cos.shape[-1] < s.head_dim:  # a partial rotary share (the op turns whole heads): torch's
            heads = qkv.view(qkv.shape[0], -1, s.head_dim)[:, :s.turned]
            c, sn = cos[self.positions].unsqueeze(1), sin[self.positions].unsqueeze(1)
            heads.copy_(apply_rope(heads, c, sn))
            return qkv
        torch.ops.tandem.rope_(qkv, cos, sin, self.positions, s.turned, s.head_dim)
        return qkv

    def split(self, qkv: torch.Tensor, s: HeadShape) -> tuple:
        if not s.kv_rows:
            return qkv.view(-1, s.heads, s.head_dim), None, None
        return split_heads(s, qkv)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.model.config.hidden_act == "gelu_tanh":
            return torch.ops.tandem.gelu_tanh_mul(gate_up)
        return torch.ops.tandem.silu_mul(gate_up)
