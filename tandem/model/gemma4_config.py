"""Gemma 4's config.json (Gemma4ForCausalLM, or the text_config of Gemma4ForConditionalGeneration) -> ModelConfig's
gemma4 switches. Its own file: the family brings more switches than any other (hf_config.py reads the rest).

What the switches mean (config.py; the decoder's branches in llama.py and gemma4.py): sliding and full layers (5:1
unless layer_types says) with their own RoPE (sliding: default at rope_local_theta; full: "proportional", the first
partial_rotary_factor of the frequency pairs turned, at rope_theta), full layers with their own head dim
(global_head_dim) and KV heads (num_global_key_value_heads, where attention_k_eq_v: no v_proj, V is K's projection),
V RMS-normed without weight, q / k norms with plain weights (no 1 + w), attention scale 1, sandwich norms, GeGLU, a
scaled embedding, a learned scalar per layer, soft-capped logits, the 26B-A4B's experts beside the dense MLP,
the small sizes' per-layer input embeddings and KV-shared last layers."""
from __future__ import annotations

from typing import Any

GEMMA4_DEFAULTS = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                   "rope_local_theta": 10_000.0, "sliding_window": 512, "global_head_dim": 512,
                   "partial_rotary_factor": 0.25}


def gemma4_layer_types(d: dict, num_layers: int) -> tuple[str, ...]:
    """layer_types as given, else every 6th layer full; the last layer is always full (transformers forces it)."""
    types = list(d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                          for i in range(num_layers)])
    types[-1] = "full_attention"
    return tuple(types)


def _global_shape(d: dict, types: tuple[str, ...]) -> tuple[int, int]:
    """(global_head_dim, global KV heads or 0) from the release's keys, or from transformers' per_layer_config (what
    it writes back: each full layer's head_dim / num_key_value_heads), which must agree over the full layers."""
    if d.get("global_head_dim") is not None or "per_layer_config" not in d:
        kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v", False) else None
        return int(d.get("global_head_dim") or GEMMA4_DEFAULTS["global_head_dim"]), int(kv or 0)
    per = {int(k): v for k, v in (d.get("per_layer_config") or {}).items() if str(k).isdigit()}
    full = [per.get(i, {}) for i, t in enumerate(types) if t == "full_attention"]
    shapes = {(int(o.get("head_dim") or d["head_dim"]), int(o.get("num_key_value_heads") or 0)) for o in full}
    if len(shapes) != 1:
        raise ValueError(f"gemma4: per_layer_config gives full layers different shapes {sorted(shapes)}")
    return shapes.pop()


def hf_gemma4(d: dict, num_layers: int) -> dict[str, Any]:
    """The gemma4 fields of ModelConfig (besides hf_config.py's common ones)."""
    if d.get("use_bidirectional_attention"):
        raise ValueError("gemma4: use_bidirectional_attention is not supported (a causal LM only)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"gemma4: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if d.get("attention_bias"):
        raise ValueError("gemma4: attention_bias=True is not supported")
    types = gemma4_layer_types(d, num_layers)
    rope = d.get("rope_parameters") or {}
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if full.get("rope_type", "proportional") not in ("proportional", "default") or \
            local.get("rope_type", "default") != "default":
        raise ValueError(f"gemma4: rope types {full.get('rope_type')!r} / {local.get('rope_type')!r} are not "
                         f"supported (proportional on full layers, default on sliding ones)")
    proportion = float(full.get("partial_rotary_factor", GEMMA4_DEFAULTS["partial_rotary_factor"]))
    if full.get("rope_type", "proportional") == "default":
        proportion = 1.0
    global_dim, global_kv = _global_shape(d, types)
    out: dict[str, Any] = dict(
        layer_types=types, sliding_window=int(d.get("sliding_window") or GEMMA4_DEFAULTS["sliding_window"]),
        rope_theta=float(full.get("rope_theta", GEMMA4_DEFAULTS["rope_theta"])), rope_scaling=None,
        rope_local_theta=float(local.get("rope_theta", GEMMA4_DEFAULTS["rope_local_theta"])),
        rope_proportion=proportion, global_head_dim=global_dim, global_kv_heads=global_kv,
        attention_k_eq_v=bool(d.get("attention_k_eq_v", False)), v_norm=True, qk_norm=True, sandwich_norm=True,
        hidden_act="gelu_tanh", embed_scale=True, query_pre_attn_scalar=1.0, layer_scalar=True,
        final_logit_softcapping=(None if d.get("final_logit_softcapping") is None
                                 else float(d["final_logit_softcapping"])),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        per_layer_input_size=int(d.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab_size=(int(d.get("vocab_size_per_layer_input") or 0)
                              if d.get("hidden_size_per_layer_input") else 0),
        num_kv_shared_layers=int(d.get("num_kv_shared_layers") or 0),
        double_wide_mlp=bool(d.get("use_double_wide_mlp", False)))
    if out["per_layer_input_size"] and not out["per_layer_vocab_size"]:
        out["per_layer_vocab_size"] = int(d["vocab_size"])
    if d.get("enable_moe_block"):
        if not d.get("num_experts") or not d.get("top_k_experts") or not d.get("moe_intermediate_size"):
            raise ValueError("gemma4: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        out.update(num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["top_k_experts"]),
                   moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=True, moe_beside_mlp=True)
    return out
