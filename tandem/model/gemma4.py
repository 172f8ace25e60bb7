"""Gemma 4's parts of the one decoder (llama.py calls them where a gemma4 switch is on, config.py names them):
the per-layer input embeddings, the experts beside the dense MLP, the end of a layer (its per-layer input added,
its learned scalar applied) and the soft-capped logits. Attention's parts (full layers' own head shape, V as K's
projection, v_norm, KV-shared layers) sit in llama.py's attention rows and kv_cache.py's GroupedKVCache.

Batch invariance (attention_paths.py states the rule): every step here is per row: RMSNorm, the decoder's linears,
the gated activation op, the router's per-row logits and top-k (moe.py), products and sums of two tensors.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .elementwise import elementwise
from .layer_ops import HeadShape
from .linear import embedding_rows, run_rows
from .moe import build_moe


class PerLayerInputs:
    """Per-layer input embeddings (E2B / E4B): a second table gives each token a [layers, P] input, mixed with a
    projection of its embedding; layer i adds gelu(gate(x)) * input[:, i] projected back to hidden (layer_end).
    transformers' order: (norm(project(x) * hidden^-1/2) + table[ids] * P^1/2) * 2^-1/2."""

    def __init__(self, ws, c: ModelConfig) -> None:
        self.layers, self.size = c.num_layers, c.per_layer_input_size
        self.table = ws.w("model.embed_tokens_per_layer.weight")              # [V', layers P]
        self.proj = ws.lin(ws.w("model.per_layer_model_projection.weight"))    # [layers P, hidden]
        self.norm = ws.norm("model.per_layer_projection_norm.weight")
        # the table's scale rounded to the model dtype, as transformers' scaled embedding multiplies
        self.table_scale = torch.tensor(self.size ** 0.5, dtype=ws.dtype).item()
        self.proj_scale = c.hidden_size ** -0.5

    def linears(self) -> list:
        return [self.proj]

    def __call__(self, ops, input_ids: torch.Tensor, x: torch.Tensor, b0: int) -> torch.Tensor:
        """input_ids [T], x [T, hidden] (the scaled embedding) -> [T, layers, P]."""
        t = input_ids.shape[0]
        tok = embedding_rows(self.table, input_ids).view(t, self.layers, self.size) * self.table_scale
        proj = (run_rows(self.proj, x, b0) * self.proj_scale).reshape(t * self.layers, self.size)
        proj = ops.norm(proj.contiguous(), self.norm).view(t, self.layers, self.size)
        return (proj + tok.to(proj.dtype)) * 2 ** -0.5


def layer_weights(ws, c: ModelConfig, i: int, native: bool, held: range | None) -> dict:
    """Layer i's gemma4 extras: its scalar, its per-layer input's gate / projection / norm, the experts beside
    the MLP with their three norms (the router's own norm has no weight: ones here, so the ops' norm serves)."""
    p, out = f"model.layers.{i}.", {}
    if c.layer_scalar:
        out["scalar"] = ws.w(p + "layer_scalar")
    if c.per_layer_input_size:
        out.update(ple_gate=ws.lin(ws.w(p + "per_layer_input_gate.weight")),
                   ple_proj=ws.lin(ws.w(p + "per_layer_projection.weight")),
                   ple_norm=ws.norm(p + "post_per_layer_input_norm.weight"))
    if c.moe_beside_mlp:
        out.update(experts=build_moe(ws, c, i, native, held, prefix="moe."),
                   post_mlp_norm_1=ws.norm(p + "post_feedforward_layernorm_1.weight"),
                   moe_norm=ws.norm(p + "pre_feedforward_layernorm_2.weight"),
                   post_moe_norm=ws.norm(p + "post_feedforward_layernorm_2.weight"),
                   router_norm=torch.ones(c.hidden_size, dtype=ws.dtype, device=ws.device))
    return out


def layer_linears(layer: dict) -> list:
    """The extras' dense linears (hold_once: each weight held once); the experts go with the MoE's."""
    return [layer[k] for k in ("ple_gate", "ple_proj") if k in layer]


def beside_mlp(ops, layer: dict, x: torch.Tensor, mlp_out: torch.Tensor, reduce) -> torch.Tensor:
    """The dense MLP's output and the experts' beside it, each normed, summed: the experts route on the residual
    stream x normed without weight (the router's scale folded into its rows: build_moe) and run on x normed by
    pre_feedforward_layernorm_2. mlp_out: the ranks' sum already; reduce: sums the experts' over the ranks (tp)."""
    dense = ops.norm(mlp_out, layer["post_mlp_norm_1"])
    routed = reduce(layer["experts"](ops.norm(x, layer["moe_norm"]), route_x=ops.norm(x, layer["router_norm"])))
    return dense + ops.norm(routed, layer["post_moe_norm"])


def layer_end(ops, layer: dict, x: torch.Tensor, delta: torch.Tensor, ple: torch.Tensor | None,
              b0: int) -> torch.Tensor:
    """The layer's output: x + delta, plus its per-layer input's contribution (gelu(gate(x)) * input, projected,
    normed), all times the layer's scalar: the residual stream itself is scaled, so delta cannot stay pending."""
    x = x + delta
    if ple is not None:
        g = ops.gated(torch.cat([run_rows(layer["ple_gate"], x, b0), ple.to(x.dtype)], dim=-1))
        x = x + ops.norm(run_rows(layer["ple_proj"], g, b0), layer["ple_norm"])
    return x * layer["scalar"] if "scalar" in layer else x


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (fp32 logits), or the logits as they are. tanh by elementwise(): torch's loop takes
    a tensor's tail by a scalar form of other bits, so a row's logits would follow the step's row count."""
    return logits if cap is None else elementwise(torch.tanh, logits / cap) * cap


def kv_rows(qkv, s: HeadShape) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K, V of the step as [T, KVH D] copies (the native ops' fused rows, or torch's three views), for
    the KV-shared layers after it."""
    if isinstance(qkv, tuple):
        return qkv[1].reshape(qkv[1].shape[0], -1).clone(), qkv[2].reshape(qkv[2].shape[0], -1).clone()
    return qkv[:, s.q_size:s.q_size + s.kv_size].clone(), qkv[:, s.q_size + s.kv_size:].clone()
