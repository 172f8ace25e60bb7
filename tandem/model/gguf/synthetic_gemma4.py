"""Gemma-4-26B-A4B's tensors and keys for synthetic.py, as llama.cpp's converter and its Q4_K_M quantization write
them (conversion/gemma.py, src/llama-quant.cpp): gguf/gemma4.py says what they mean.

The type rules that apply (llama_tensor_get_type): Q4_K by default; the tied embedding Q6_K (the head's type);
attn_v Q6_K on the layers use_more_bits picks among those that have one (only the sliding layers: the full ones take
V from K); ffn_down and ffn_down_exps Q6_K on the layers it picks among all; the router (ffn_gate_inp), norms and
scales F32; and where a row is not whole 256-weight super-blocks (the dense MLP's 2112, an expert's 704 for the
down projections) llama.cpp's fallback, Q5_0 for Q4_K and Q8_0 for Q6_K.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

F32, Q4_K, Q6_K, Q5_0, Q8_0 = (int(t) for t in (T.F32, T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0))
SLIDING_THETA = 10_000.0        # the sliding layers' RoPE base (full layers: the shape's rope_theta)
PROPORTION = 0.25               # the full layers' proportional RoPE turns this share of the frequency pairs
SOFTCAP = 30.0                  # final_logit_softcapping
PATTERN = 6                     # every 6th layer full, and the last


def is_sliding(i: int, n: int) -> bool:
    return (i + 1) % PATTERN != 0 and i != n - 1


def _fallback(qtype: int, k: int) -> int:
    """llama.cpp's type for a row of k weights that is not whole super-blocks (tensor_type_fallback)."""
    return qtype if k % 256 == 0 else {Q4_K: Q5_0, Q6_K: Q8_0}[qtype]


def gemma4_types(s, more_bits: Callable[[int, int], bool]) -> dict[str, tuple[tuple[int, ...], int]]:
    """GGUF tensor name -> ((dims, numpy order), ggml type) of Gemma 4 shape s (synthetic.Shape with full_attention
    = (head dim, KV heads) of the full layers); more_bits: llama.cpp's use_more_bits."""
    h, n, e, m, ff = s.hidden, s.layers, s.experts, s.expert_width, s.intermediate
    gd, gkv = s.full_attention
    v_layers = [i for i in range(n) if is_sliding(i, n)]
    out: dict[str, tuple[tuple[int, ...], int]] = {"token_embd.weight": ((s.vocab, h), Q6_K)}
    for i in range(n):
        b, more, sliding = f"blk.{i}.", more_bits(i, n), is_sliding(i, n)
        d, kv = (s.head_dim, s.kv_heads) if sliding else (gd, gkv)
        down = Q6_K if more else Q4_K
        out.update({b + "attn_norm.weight": ((h,), F32), b + "attn_q.weight": ((s.heads * d, h), Q4_K),
                    b + "attn_k.weight": ((kv * d, h), Q4_K)})
        if sliding:
            out[b + "attn_v.weight"] = ((kv * d, h), Q6_K if more_bits(v_layers.index(i), len(v_layers)) else Q4_K)
        out.update({b + "attn_q_norm.weight": ((d,), F32), b + "attn_k_norm.weight": ((d,), F32),
                    b + "attn_output.weight": ((h, s.heads * d), Q4_K), b + "post_attention_norm.weight": ((h,), F32),
                    b + "ffn_norm.weight": ((h,), F32), b + "ffn_gate.weight": ((ff, h), Q4_K),
                    b + "ffn_up.weight": ((ff, h), Q4_K), b + "ffn_down.weight": ((h, ff), _fallback(down, ff)),
                    b + "post_ffw_norm.weight": ((h,), F32), b + "ffn_gate_inp.weight": ((e, h), F32),
                    b + "ffn_gate_inp.scale": ((h,), F32), b + "ffn_gate_up_exps.weight": ((e, 2 * m, h), Q4_K),
                    b + "ffn_down_exps.weight": ((e, h, m), _fallback(down, m)),
                    b + "ffn_down_exps.scale": ((e,), F32), b + "pre_ffw_norm_2.weight": ((h,), F32),
                    b + "post_ffw_norm_1.weight": ((h,), F32), b + "post_ffw_norm_2.weight": ((h,), F32),
                    b + "layer_output_scale.weight": ((1,), F32)})
    out["output_norm.weight"] = ((h,), F32)
    out["rope_freqs.weight"] = ((gd // 2,), F32)
    return out


def gemma4_f32(name: str, dims: tuple[int, ...]) -> np.ndarray | None:
    """The F32 tensors whose value matters: the proportional RoPE's frequency factors, scales and the per-layer
    scalar at 1 (None: synthetic.py's default)."""
    if name == "rope_freqs.weight":
        turned = int(dims[0] * PROPORTION)
        return np.array([1.0] * turned + [1e30] * (dims[0] - turned), np.float32)
    if name.endswith((".scale", "layer_output_scale.weight")):
        return np.ones(dims, np.float32)
    return None


def gemma4_metadata(w, s) -> None:
    """The keys llama.cpp's converter writes for Gemma 4 (Gemma3Model's and Gemma4Model's set_gguf_parameters)."""
    n, (gd, gkv) = s.layers, s.full_attention
    sliding = [is_sliding(i, n) for i in range(n)]
    w.add_block_count(n)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv([s.kv_heads if x else gkv for x in sliding])
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_freq_base_swa(SLIDING_THETA)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_used)
    w.add_expert_feed_forward_length(s.expert_width)
    w.add_key_length(gd)
    w.add_value_length(gd)
    w.add_key_length_swa(s.head_dim)
    w.add_value_length_swa(s.head_dim)
    w.add_final_logit_softcapping(SOFTCAP)
    w.add_sliding_window(s.sliding)
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    w.add_sliding_window_pattern(sliding)
    w.add_rope_dimension_count(gd)
    w.add_rope_dimension_count_swa(s.head_dim)
