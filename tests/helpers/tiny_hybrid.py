"""write_hybrid_gguf: a tiny transformers hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next from tiny_models.make_tiny_model)
as the GGUF llama.cpp's convert_hf_to_gguf.py writes (checked against that script's output: every key tandem reads,
every tensor's name, shape and bits):
- every RMSNorm but the Gated DeltaNet's as (1 + w); A_log as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; the conv
  squeezed to [C, width]; the metadata's ssm.* keys, recurrent layers and rotary dims;
- Qwen3.5's value heads reordered from grouped by key head to tiled over the key heads (rows of the qkv's v part, of
  z, b, a, A, dt and the conv's v channels; columns of out_proj);
- Qwen3-Next's in_proj_qkvz regrouped into attn_qkv and attn_gate, its in_proj_ba kept as ssm_ba.
"""
from __future__ import annotations

import json
import os

import numpy as np

_ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
_LINEAR = {"in_proj_qkv.weight": "attn_qkv.weight", "in_proj_z.weight": "attn_gate.weight",
           "in_proj_b.weight": "ssm_beta.weight", "in_proj_a.weight": "ssm_alpha.weight",
           "in_proj_ba.weight": "ssm_ba.weight", "conv1d.weight": "ssm_conv1d.weight", "dt_bias": "ssm_dt.bias",
           "A_log": "ssm_a", "norm.weight": "ssm_norm.weight", "out_proj.weight": "ssm_out.weight"}
_SHARED = {"mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
           "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
           "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
           "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}


def write_hybrid_gguf(path, hf_dir: str, quant: str = "F32", with_tokenizer: bool = False) -> str:
    """The hybrid in hf_dir as llama.cpp's GGUF; quant as tiny_models.write_tiny_gguf's (the conv, the routers and
    the shared expert's gate stay F32, as llama.cpp keeps them)."""
    import gguf
    from safetensors.numpy import load_file

    from tests.helpers.tiny_models import _add_tensor, _add_tokenizer, _tensor_names
    from tests.helpers.tiny_moe import stack_experts

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = _ARCH[cfg["model_type"]]
    sd = stack_experts(load_file(os.path.join(hf_dir, "model.safetensors")), False)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, cfg, arch)
    _add_tokenizer(w, cfg, with_tokenizer)
    block, glob = _tensor_names(arch)
    block["post_attention_layernorm.weight"] = "post_attention_norm.weight"
    block.update(_SHARED)
    for name, t in sd.items():
        for gname, a in _converted(name, np.asarray(t, dtype=np.float32), cfg, arch, block, glob):
            kind = ("F32" if gname.endswith(("ssm_conv1d.weight", "ffn_gate_inp_shexp.weight")) or a.shape[-1] % 32
                    else quant)                           # rows not of whole 32-blocks stay F32 here
            _add_tensor(w, gname, np.ascontiguousarray(a), kind, False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _metadata(w, cfg: dict, arch: str) -> None:
    from tests.helpers.tiny_moe import add_expert_metadata

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("num_experts"):
        add_expert_metadata(w, {**cfg, "model_type": "qwen3_moe"})
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    hv = cfg["linear_num_value_heads"]
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", hv)
    w.add_uint32(f"{arch}.ssm.inner_size", cfg["linear_value_head_dim"] * hv)
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_uint32(f"{arch}.full_attention_interval", cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":
        w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])


def _converted(name: str, t: np.ndarray, cfg: dict, arch: str, block: dict, glob: dict):
    """[(GGUF name, array)] of one HF tensor, transformed as the converter does."""
    if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
        return []
    if name.endswith("norm.weight") and ".linear_attn." not in name:
        t = t + 1
    if name in glob or name.startswith("blk."):
        return [(glob.get(name, name), t)]
    parts = name.split(".")
    prefix, rest = f"blk.{parts[2]}.", ".".join(parts[3:])
    if not rest.startswith("linear_attn."):
        return [(prefix + block[rest], t)]
    rest = rest[len("linear_attn."):]
    nk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if rest == "in_proj_qkvz.weight":                     # Qwen3-Next: [q k v z] a key head -> [q.. k.. v..], [z..]
        q, k, v, z = np.split(t.reshape(nk, -1, t.shape[-1]), np.cumsum([dk, dk, hv // nk * dv])[:3], axis=1)
        qkv = np.concatenate([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
        return [(prefix + "attn_qkv.weight", qkv), (prefix + "attn_gate.weight", z.reshape(-1, t.shape[-1]))]
    if rest == "A_log":                                   # in torch, as the converter: numpy's exp rounds otherwise
        import torch
        t = (-torch.exp(torch.from_numpy(t))).numpy()
    if rest == "conv1d.weight":
        t = t.reshape(t.shape[0], -1)
    if arch != "qwen3next" and nk != hv:
        t = _tiled(rest, t, nk, hv, dk, dv)
    return [(prefix + _LINEAR[rest], t)]


def _tiled(rest: str, t: np.ndarray, nk: int, hv: int, dk: int, dv: int) -> np.ndarray:
    """Value heads from grouped (key head g's r heads together) to tiled (the j-th head of every key head)."""
    def reorder(a: np.ndarray, axis: int, head: int) -> np.ndarray:
        a = np.moveaxis(a, axis, 0)
        a = a.reshape(nk, hv // nk, head, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        return np.moveaxis(a, 0, axis)

    if rest in ("in_proj_qkv.weight", "conv1d.weight"):
        return np.concatenate([t[:2 * nk * dk], reorder(t[2 * nk * dk:], 0, dv)])
    if rest == "out_proj.weight":
        return reorder(t, 1, dv)
    if rest in ("in_proj_z.weight",):
        return reorder(t, 0, dv)
    if rest in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return reorder(t, 0, 1)
    return t
