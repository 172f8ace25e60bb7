"""The decoder's weight contract: every Hugging Face state-dict name llama.py reads, with its shape. Both
loaders (safetensors in loader.py, GGUF in gguf/weights.py) check what they read against it."""

from __future__ import annotations

import re

from .config import ModelConfig

# Keys some checkpoints carry that are not weights.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF state-dict key the model needs, with its shape."""
    c = config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),    # gemma3: after attention; else: before the MLP
        })
        shapes.update(_mlp_shapes(c, i) if not c.is_moe(i) else expert_shapes(c, i))
        if c.sandwich_norm:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,),
                           p + "self_attn.k_norm.weight": (c.head_dim,)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,),
                           p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _mlp_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    p, h, n = f"model.layers.{i}.mlp.", c.hidden_size, c.intermediate_size
    return {p + "gate_proj.weight": (n, h), p + "up_proj.weight": (n, h), p + "down_proj.weight": (h, n)}


def expert_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """An MoE layer's router (mlp.gate: [E, hidden]) and each expert's gated MLP (Qwen3-MoE's names)."""
    p, h, n = f"model.layers.{i}.mlp.", c.hidden_size, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (c.num_experts, h)}
    for e in range(c.num_experts):
        q = f"{p}experts.{e}."
        shapes.update({q + "gate_proj.weight": (n, h), q + "up_proj.weight": (n, h), q + "down_proj.weight": (h, n)})
    return shapes


# Mixtral's checkpoint names -> the contract's (Qwen3-MoE's): block_sparse_moe is mlp, w1 / w3 / w2 gate / up / down.
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(gate\.weight|experts\.\d+\.w[123]\.weight)$")
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_weight_name(name: str) -> str:
    """The contract's name of a checkpoint key (Mixtral's expert names renamed; every other key as it is)."""
    m = _MIXTRAL_EXPERT.search(name)
    if m is None:
        return name
    rest = m.group(1)
    if rest.endswith(".weight") and rest.startswith("experts."):
        _, e, w, _ = rest.split(".")
        rest = f"experts.{e}.{_MIXTRAL_W[w]}.weight"
    return name[:m.start()] + ".mlp." + rest


def name_list(names: list[str], limit: int = 8) -> str:
    """The first `limit` names for an error message, and " ..." when there are more."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
