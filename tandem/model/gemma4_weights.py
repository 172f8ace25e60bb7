"""Gemma 4's part of the weight contract (weights.py): the names and shapes llama.py / gemma4.py read, and
transformers' stacked experts and router (layers.{i}.experts.*, layers.{i}.router.*) in the contract's names (the
experts beside the MLP under "moe.", the way moe.build_moe reads them)."""
from __future__ import annotations

import re

from .config import ModelConfig

# A Gemma4ForConditionalGeneration checkpoint's towers: not served (the text model is; images are another issue's)
GEMMA4_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def gemma4_layer_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's attention rows (its own head shape; no v_proj where V is K's projection; q only in a KV-shared
    layer), its scalar, its per-layer input's weights and the experts beside its MLP."""
    p, h, d, kvh = f"model.layers.{i}.", c.hidden_size, c.layer_head_dim(i), c.layer_kv_heads(i)
    shapes: dict[str, tuple[int, ...]] = {p + "self_attn.q_proj.weight": (c.num_heads * d, h),
                                          p + "self_attn.o_proj.weight": (h, c.num_heads * d),
                                          p + "self_attn.q_norm.weight": (d,), p + "layer_scalar": (1,)}
    if c.kv_source(i) == i:
        shapes.update({p + "self_attn.k_proj.weight": (kvh * d, h), p + "self_attn.k_norm.weight": (d,)})
        if not (c.attention_k_eq_v and not c.is_sliding(i)):
            shapes[p + "self_attn.v_proj.weight"] = (kvh * d, h)
    if (n := c.per_layer_input_size):
        shapes.update({p + "per_layer_input_gate.weight": (n, h), p + "per_layer_projection.weight": (h, n),
                       p + "post_per_layer_input_norm.weight": (h,)})
    if c.moe_beside_mlp:
        q, e, m = p + "moe.", c.num_experts, c.moe_intermediate_size
        shapes.update({q + "gate.weight": (e, h), q + "router_scale": (h,), q + "per_expert_scale": (e,)})
        for x in range(e):
            shapes.update({f"{q}experts.{x}.gate_proj.weight": (m, h), f"{q}experts.{x}.up_proj.weight": (m, h),
                           f"{q}experts.{x}.down_proj.weight": (h, m)})
        shapes.update({p + n + ".weight": (h,) for n in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                                                         "post_feedforward_layernorm_2")})
    return shapes


def gemma4_model_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The per-layer inputs' table, projection and norm (E2B / E4B)."""
    if not (n := c.per_layer_input_size):
        return {}
    return {"model.embed_tokens_per_layer.weight": (c.per_layer_vocab_size, c.num_layers * n),
            "model.per_layer_model_projection.weight": (c.num_layers * n, c.hidden_size),
            "model.per_layer_projection_norm.weight": (n,)}


_STACKED = re.compile(r"\.layers\.(\d+)\.(experts\.(gate_up_proj|down_proj)|"
                      r"router\.(proj\.weight|scale|per_expert_scale))$")
_ROUTER = {"proj.weight": "gate.weight", "scale": "router_scale", "per_expert_scale": "per_expert_scale"}


def split_gemma4_experts(name: str, t) -> list | None:
    """[(name, tensor)] in the contract's names of one of transformers' Gemma 4 expert tensors (gate_up_proj [E, 2I,
    hidden]: gate rows, then up rows; down_proj [E, hidden, I]; both output-major) or router tensors; None for any
    other name."""
    m = _STACKED.search(name)
    if m is None:
        return None
    p = name[:m.start()] + f".layers.{m.group(1)}.moe."
    if m.group(4):
        return [(p + _ROUTER[m.group(4)], t)]
    out = []
    for e in range(t.shape[0]):
        q = f"{p}experts.{e}."
        if m.group(3) == "down_proj":
            out.append((q + "down_proj.weight", t[e].contiguous()))
        else:
            gate, up = t[e].chunk(2, dim=0)
            out += [(q + "gate_proj.weight", gate.contiguous()), (q + "up_proj.weight", up.contiguous())]
    return out
