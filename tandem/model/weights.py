"""The decoder's weight contract: every Hugging Face state-dict name llama.py reads, with its shape. Both
loaders (safetensors in loader.py, GGUF in gguf/weights.py) check what they read against it."""

from __future__ import annotations

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
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        })
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


def name_list(names: list[str], limit: int = 8) -> str:
    """The first `limit` names for an error message, and " ..." when there are more."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
