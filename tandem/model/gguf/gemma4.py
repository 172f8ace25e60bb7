"""Gemma 4 text models as llama.cpp's converter writes them (general.architecture "gemma4"): the keys that carry
ModelConfig's gemma4 switches, and the tensor names as tandem's (model/gemma4_config.py says what they mean).

What the file holds (conversion/gemma.py's Gemma4Model, src/models/gemma4.cpp): key_length / value_length are the
full layers' head dim, key_length_swa / value_length_swa the sliding layers'; attention.sliding_window_pattern one
bool a layer (True: sliding); head_count_kv an array a layer where full layers have their own KV heads;
feed_forward_length an array where the KV-shared layers' MLP is double-wide; rope.freq_base for full layers and
rope.freq_base_swa for sliding ones, the full layers' proportional RoPE as a rope_freqs tensor (1 on the turned
frequency pairs, 1e30 on the rest) over rope.dimension_count = the full head dim; attention.shared_kv_layers,
embedding_length_per_layer_input, final_logit_softcapping. The norms are stored as the checkpoint holds them (Gemma
4's RMSNorm multiplies by w: no 1 + w, unlike gemma3's files), the experts' gate_up_proj stays fused
(ffn_gate_up_exps [E, 2I, h]: gate the first I rows), router.scale is ffn_gate_inp.scale, router.per_expert_scale
ffn_down_exps.scale and layer_scalar layer_output_scale.weight; V-as-K full layers have no attn_v, KV-shared layers
no attn_k / attn_v / attn_k_norm.
"""
from __future__ import annotations

import numpy as np


FUSED_EXPERTS = ".experts.gate_up_proj.weight"      # [E, 2I, h]: split per expert (gate, up) at load
GEMMA4_GLOBAL_NAMES = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                       "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                       "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
GEMMA4_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "moe.gate.weight",
    "ffn_gate_inp.scale": "moe.router_scale",
    "ffn_down_exps.scale": "moe.per_expert_scale",
    "ffn_gate_up_exps.weight": "moe" + FUSED_EXPERTS,
    "ffn_gate_exps.weight": "moe.experts.gate_proj.weight",     # llama.cpp also loads them split
    "ffn_up_exps.weight": "moe.experts.up_proj.weight",
    "ffn_down_exps.weight": "moe.experts.down_proj.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
_UNSUPPORTED = {"attn_qkv.weight": "a fused attn_qkv (q, k and v in one matrix)"}


def unsupported_tensor(block_name: str) -> str | None:
    """Why a gemma4 block tensor the contract cannot hold is refused (None: not one of them)."""
    return _UNSUPPORTED.get(block_name)


def _f32(x) -> float:
    """Shortest decimal that round-trips a float32 metadata value."""
    return float(str(np.float32(x)))


def _per_layer(v, n: int, what: str) -> list[int]:
    """A key that is a scalar or one value a layer, as a list of n ints."""
    vals = [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)] * n
    if len(vals) != n:
        raise ValueError(f"gemma4: {what} has {len(vals)} values for {n} layers")
    return vals


def _proportion(freqs: np.ndarray | None, dim: int, n_rot: int) -> float:
    """Full layers' rope_proportion from rope_freqs: the leading pairs at 1 turn, the 1e30 rest stay."""
    if n_rot != dim:
        raise ValueError(f"gemma4: full layers turn {n_rot} of {dim} dims by rope.dimension_count; only the "
                         f"proportional RoPE (rope_freqs over the whole head) is supported")
    if freqs is None:
        return 1.0
    turned = int(np.argmax(freqs != 1.0)) if (freqs != 1.0).any() else len(freqs)
    if freqs.shape != (dim // 2,) or turned == 0 or not (freqs[turned:] >= 1e29).all():
        raise ValueError(f"gemma4: rope_freqs {freqs.tolist()[:8]}... is not the proportional RoPE's (1 on the "
                         f"first pairs, 1e30 on the rest, {dim // 2} values)")
    return 2 * turned / dim


def _k_eq_v(tensors: dict, sliding: list[bool], n_own: int) -> bool:
    """Whether full layers take V from k_proj: they have attn_k and no attn_v (all alike)."""
    full = [i for i in range(n_own) if not sliding[i] and f"blk.{i}.attn_k.weight" in tensors]
    no_v = {f"blk.{i}.attn_v.weight" not in tensors for i in full}
    if len(no_v) > 1:
        raise ValueError("gemma4: some full layers have attn_v and some do not")
    if any(f"blk.{i}.attn_v.weight" not in tensors for i in range(n_own) if sliding[i]):
        raise ValueError("gemma4: a sliding layer has no attn_v (only full layers may take V from K)")
    return no_v == {True}


def gemma4_switches(get, tensors: dict, num_layers: int, freqs: np.ndarray | None) -> dict:
    """ModelConfig's gemma4 fields (and its head_dim / num_kv_heads / intermediate_size, which the file keeps per
    layer kind) from the keys: get(key, default) reads gemma4.<key>; freqs: the rope_freqs tensor or None."""
    def req(key: str):
        v = get(key, None)
        if v is None:
            raise ValueError(f"GGUF file is missing metadata key gemma4.{key}")
        return v

    n = num_layers
    sliding = [bool(x) for x in req("attention.sliding_window_pattern")]
    if len(sliding) != n:
        raise ValueError(f"gemma4: attention.sliding_window_pattern has {len(sliding)} values for {n} layers")
    head_dim, global_dim = int(req("attention.key_length_swa")), int(req("attention.key_length"))
    if int(get("attention.value_length_swa", head_dim)) != head_dim or \
            int(get("attention.value_length", global_dim)) != global_dim:
        raise ValueError("gemma4: value heads of another width than the key heads are not supported")
    if int(get("rope.dimension_count_swa", head_dim)) != head_dim:
        raise ValueError("gemma4: sliding layers' partial RoPE (rope.dimension_count_swa < key_length_swa) is not "
                         "supported")
    kv = _per_layer(req("attention.head_count_kv"), n, "attention.head_count_kv")
    shared = int(get("attention.shared_kv_layers", 0) or 0)
    n_own = n - shared
    k_eq_v = _k_eq_v(tensors, sliding, n_own)
    num_kv = next((kv[i] for i in range(n) if sliding[i]), kv[0])
    full_kv = next((kv[i] for i in range(n) if not sliding[i]), num_kv)
    if any(kv[i] != (num_kv if sliding[i] else full_kv) for i in range(n)):
        raise ValueError(f"gemma4: KV heads {kv} differ within a layer kind")
    # a count of their own where the converter wrote one a layer: under k_eq_v always (transformers' config keeps
    # num_global_key_value_heads then), otherwise only where it differs
    per_layer = isinstance(get("attention.head_count_kv", 0), (list, tuple))
    global_kv = full_kv if per_layer and (k_eq_v or full_kv != num_kv) else 0
    ff = _per_layer(req("feed_forward_length"), n, "feed_forward_length")
    double = bool(shared) and ff == [ff[0] if i < n_own else 2 * ff[0] for i in range(n)] and ff[0] != ff[-1]
    if not double and len(set(ff)) > 1:
        raise ValueError(f"gemma4: feed_forward_length {ff} is neither one width nor double in the KV-shared layers")
    window = req("attention.sliding_window")
    softcap = get("final_logit_softcapping", None)
    ple = int(get("embedding_length_per_layer_input", 0) or 0)
    ple_table = tensors.get("per_layer_token_embd.weight")
    if ple and ple_table is None:
        raise ValueError("gemma4: embedding_length_per_layer_input is set but per_layer_token_embd is missing")
    return dict(
        head_dim=head_dim, num_kv_heads=num_kv, intermediate_size=ff[0],
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
        sliding_window=int(window), rope_local_theta=_f32(get("rope.freq_base_swa", 10_000.0)),
        rope_proportion=_proportion(freqs, global_dim, int(get("rope.dimension_count", global_dim))),
        global_head_dim=global_dim, global_kv_heads=global_kv, attention_k_eq_v=k_eq_v, v_norm=True,
        qk_norm=True, sandwich_norm=True, norm_offset=0.0, hidden_act="gelu_tanh", embed_scale=True,
        query_pre_attn_scalar=1.0, layer_scalar=True,
        final_logit_softcapping=None if not softcap else _f32(softcap),
        per_layer_input_size=ple, per_layer_vocab_size=int(ple_table.shape[0]) if ple else 0,
        num_kv_shared_layers=shared, double_wide_mlp=double)
