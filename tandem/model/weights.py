"""The decoder's weight contract: every Hugging Face state-dict name llama.py reads, with its shape. Both
loaders (safetensors in loader.py, GGUF in gguf/weights.py) check what they read against it."""

from __future__ import annotations

import re
from typing import Container

import torch

from .config import ModelConfig
from .gemma4_weights import GEMMA4_TOWERS, gemma4_layer_shapes, gemma4_model_shapes, split_gemma4_experts

# Keys some checkpoints carry that are not weights.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)
# Keys of parts tandem does not serve: a vision-language checkpoint's vision tower, the multi-token-prediction
# head Qwen3.5 / Qwen3-Next ship for speculative decoding.
IGNORABLE_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.", *GEMMA4_TOWERS)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF state-dict key the model needs, with its shape."""
    c = config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})   # gemma3: after attention; else: before the MLP
        shapes.update(_mlp_shapes(c, i) if not c.is_moe(i) else expert_shapes(c, i))
        if c.sandwich_norm:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
        if c.is_linear(i):
            shapes.update(linear_attention_shapes(c, i))
            continue
        if c.architecture == "gemma4":
            shapes.update(gemma4_layer_shapes(c, i))
            continue
        shapes.update({
            p + "self_attn.q_proj.weight": (q * (2 if c.attn_output_gate else 1), h),   # gated: each head's q, gate
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        })
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,),
                           p + "self_attn.k_norm.weight": (c.head_dim,)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,),
                           p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if c.attention_sinks:
            shapes[p + "self_attn.sinks"] = (c.num_heads,)
    shapes.update(gemma4_model_shapes(c))
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _mlp_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    p, h, n = f"model.layers.{i}.mlp.", c.hidden_size, c.mlp_width(i)
    return {p + "gate_proj.weight": (n, h), p + "up_proj.weight": (n, h), p + "down_proj.weight": (h, n)}


def linear_attention_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's weights in Qwen3.5's names (Qwen3-Next's fused qkvz / ba are split into them at
    load: split_fused)."""
    p, h = f"model.layers.{i}.linear_attn.", c.hidden_size
    vd, hv = c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads
    return {p + "in_proj_qkv.weight": (c.linear_conv_dim, h), p + "in_proj_z.weight": (vd, h),
            p + "in_proj_b.weight": (hv, h), p + "in_proj_a.weight": (hv, h),
            p + "conv1d.weight": (c.linear_conv_dim, 1, c.linear_conv_kernel), p + "dt_bias": (hv,), p + "A_log": (hv,),
            p + "norm.weight": (c.linear_value_head_dim,), p + "out_proj.weight": (h, vd)}


def split_fused(name: str, t, c: ModelConfig) -> list:
    """[(name, tensor)] of a checkpoint tensor in the contract's names: Qwen3-Next's in_proj_qkvz (per key head:
    its q, k, then its value heads' v and z rows) and in_proj_ba (per key head: its value heads' b, then a) as
    Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, the rows regrouped (q heads, k heads, v heads).
    GGUF blocks stay blocks (whole rows move). gpt-oss's stacked experts and router: split_gpt_oss_experts."""
    if (experts := split_gpt_oss_experts(name, t)) is not None:
        return experts
    if c.architecture == "gemma4" and (experts := split_gemma4_experts(name, t)) is not None:
        return experts
    if not name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
        return [(name, t)]
    from .linear import take_rows
    p = name[: name.rindex("in_proj_")]
    nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // nk                      # value heads a key head serves
    sizes = [r, r] if name.endswith("ba.weight") else [dk, dk, r * dv, r * dv]
    rows = torch.arange(t.shape[0]).view(nk, -1).split(sizes, dim=1)      # each part's rows, key head by key head
    parts = [take_rows(t, part.reshape(-1)) for part in rows]
    if name.endswith("ba.weight"):
        return [(p + "in_proj_b.weight", parts[0]), (p + "in_proj_a.weight", parts[1])]
    qkv = take_rows(t, torch.cat([part.reshape(-1) for part in rows[:3]]))
    return [(p + "in_proj_qkv.weight", qkv), (p + "in_proj_z.weight", parts[3])]


def expert_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """An MoE layer's router (mlp.gate: [E, hidden]), each expert's gated MLP (Qwen3-MoE's names) and its shared
    expert with the shared expert's gate (Qwen3.5-MoE, Qwen3-Next)."""
    p, h, n = f"model.layers.{i}.mlp.", c.hidden_size, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (c.num_experts, h)}
    if (s := c.shared_expert_intermediate_size):
        q = p + "shared_expert."
        shapes.update({q + "gate_proj.weight": (s, h), q + "up_proj.weight": (s, h), q + "down_proj.weight": (h, s),
                       p + "shared_expert_gate.weight": (1, h)})
    for e in range(c.num_experts):
        q = f"{p}experts.{e}."
        shapes.update({q + "gate_proj.weight": (n, h), q + "up_proj.weight": (n, h), q + "down_proj.weight": (h, n)})
        if c.moe_bias:
            shapes.update({q + "gate_proj.bias": (n,), q + "up_proj.bias": (n,), q + "down_proj.bias": (h,)})
    if c.moe_bias:
        shapes[p + "gate.bias"] = (c.num_experts,)
    return shapes


def split_gpt_oss_experts(name: str, t) -> list | None:
    """[(name, tensor)] in the contract's names of one of gpt-oss's stacked expert tensors (gate_up_proj [E, hidden,
    2I], its gate and up columns interleaved, and down_proj [E, I, hidden], both input-major; their biases [E, 2I],
    [E, hidden]) and of its router (mlp.router.*: the contract's mlp.gate.*); None for any other name."""
    m = re.search(r"\.mlp\.(experts\.(gate_up_proj|down_proj)(_bias)?|router\.(weight|bias))$", name)
    if m is None:
        return None
    p = name[:m.start()] + ".mlp."
    if m.group(4):
        return [(p + "gate." + m.group(4), t)]
    bias = bool(m.group(3))
    out = []
    for e in range(t.shape[0]):
        q = f"{p}experts.{e}."
        w = t[e] if bias else t[e].t()                     # weights as [out, in]
        if m.group(2) == "down_proj":
            out.append((q + "down_proj." + ("bias" if bias else "weight"), w.contiguous()))
        else:
            kind = "bias" if bias else "weight"
            out += [(q + "gate_proj." + kind, w[0::2].contiguous()), (q + "up_proj." + kind, w[1::2].contiguous())]
    return out


# Mixtral's checkpoint names -> the contract's (Qwen3-MoE's): block_sparse_moe is mlp, w1 / w3 / w2 gate / up / down.
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(gate\.weight|experts\.\d+\.w[123]\.weight)$")
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_weight_name(name: str) -> str:
    """The contract's name of a checkpoint key (a vision-language checkpoint's language model as the text model's,
    Mixtral's expert names renamed; every other key as it is)."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    m = _MIXTRAL_EXPERT.search(name)
    if m is None:
        return name
    rest = m.group(1)
    if rest.endswith(".weight") and rest.startswith("experts."):
        _, e, w, _ = rest.split(".")
        rest = f"experts.{e}.{_MIXTRAL_W[w]}.weight"
    return name[:m.start()] + ".mlp." + rest


def layer_index(name: str) -> int | None:
    """The decoder layer of a contract name (model.layers.<i>. ...); None for the others (embedding, norm, head)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


def in_layers(name: str, layers: Container[int] | None) -> bool:
    """Whether a load (or a pipeline stage) limited to `layers` (None: every layer) keeps this weight: every one
    outside the decoder layers, and those of its layers."""
    i = layer_index(name)
    return layers is None or i is None or i in layers


def name_list(names: list[str], limit: int = 8) -> str:
    """The first `limit` names for an error message, and " ..." when there are more."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
