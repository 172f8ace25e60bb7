"""Tiny random Gemma 4 text models (transformers' Gemma4ForCausalLM) and the GGUF llama.cpp's converter writes for
them (conversion/gemma.py's Gemma4Model, checked against that script's output: every key, tensor name, shape and
value), for the GGUF reader's tests and the decoder's parity tests.

What llama.cpp's gemma4 file holds that differs from the checkpoint: no norm offset (Gemma 4's RMSNorm multiplies by
w; gemma3's files add 1, gemma4's do not), the experts' gate_up_proj kept fused as ffn_gate_up_exps [E, 2I, h],
router.scale as ffn_gate_inp.scale, router.per_expert_scale as ffn_down_exps.scale, layer_scalar as
layer_output_scale.weight, a rope_freqs tensor (1 on the turned pairs of a full layer, 1e30 on the rest: the
proportional RoPE) and the per-layer head dims / KV heads / sliding pattern as keys (key_length for full layers,
key_length_swa for sliding ones).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

# Each model exercises its switches: sliding layers of 4 heads of 16 with 2 KV heads, full layers of 32 with their
# own KV heads (k_eq_v) or the sliding ones', a window of 8, a local RoPE base and a quarter-turned full RoPE.
BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             global_head_dim=32, sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-6,
             final_logit_softcapping=30.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 10000.0}})
# dense: per-layer inputs and 2 KV-shared last layers (one sliding, one full) with a double-wide MLP
DENSE = dict(num_hidden_layers=5, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                               "sliding_attention", "full_attention"],
             hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
             attention_k_eq_v=False)
# MoE (26B-A4B's kind): 8 experts of 32, top 2, beside the dense MLP; full layers' K is V, with 1 KV head
MOE = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
           hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True,
           num_global_key_value_heads=1, enable_moe_block=True, num_experts=8, top_k_experts=2,
           moe_intermediate_size=32)


def make_tiny_gemma4(tmp_dir, moe: bool = False, *, seed: int = 0, cache_dir: str | None = None,
                     **overrides) -> str:
    """Save a tiny random Gemma4ForCausalLM (DENSE or MOE above, plus HF config overrides) in fp32 with the SmolLM2
    tokenizer into tmp_dir; norms, scalars and the router's scales are randomized too (HF initializes them to 1 /
    0). Returns the directory."""
    import transformers as tf

    from tests.helpers.tiny_models import smollm2_tokenizer

    tok = smollm2_tokenizer(cache_dir)
    kw = dict(BASE, vocab_size=len(tok), vocab_size_per_layer_input=len(tok), bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    kw.update(MOE if moe else DENSE)
    kw.update(overrides)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**kw)).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    os.makedirs(tmp_dir, exist_ok=True)
    model.save_pretrained(str(tmp_dir))
    tok.save_pretrained(str(tmp_dir))
    return str(tmp_dir)


_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
           "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
           "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight",
          "post_attention_layernorm.weight": "post_attention_norm.weight",
          "pre_feedforward_layernorm.weight": "ffn_norm.weight",
          "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "layer_scalar": "layer_output_scale.weight",
          "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
          "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
          "experts.down_proj": "ffn_down_exps.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
          "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
          "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
          "per_layer_input_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
          "post_per_layer_input_norm.weight": "post_norm.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Gemma4ForCausalLM state-dict key (gguf-py's tensor map for gemma4)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")                  # model.layers.N.rest
    return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:])]}"


def write_gemma4_gguf(path, hf_dir: str, quant: str = "F32", with_tokenizer: bool = True) -> str:
    """The model in hf_dir (make_tiny_gemma4) as llama.cpp's converter writes it: quant "F32" or "F16" for the
    matrices (llama.cpp's --outtype; 1-D tensors, the router and the scales stay F32), or tiny_models' quant names."""
    import gguf
    from safetensors.numpy import load_file

    from tests.helpers.tiny_models import _add_tensor, _add_tokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    blocked = quant not in ("F32", "F16", "BF16")
    w = gguf.GGUFWriter(str(path), "gemma4")
    _metadata(w, cfg)
    _add_tokenizer(w, cfg, with_tokenizer)
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", True):
            continue
        a = np.ascontiguousarray(t, dtype=np.float32)
        kind = "F32" if blocked and a.shape[-1] % 32 else quant    # llama.cpp: rows of no whole block stay F32
        _add_tensor(w, gguf_tensor_name(name), a, kind, bool(cfg.get("tie_word_embeddings", True)))
    w.add_tensor("rope_freqs.weight", rope_freqs(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _full_shape(cfg: dict) -> tuple[int, int | None]:
    """(full layers' head dim, their KV heads or None), from global_head_dim or per_layer_config as the converter
    reads them."""
    per = cfg.get("per_layer_config") or {}
    full = [per.get(str(i), per.get(i, {})) for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    dim = cfg.get("global_head_dim") or next(p["head_dim"] for p in full if "head_dim" in p)
    kv = cfg.get("num_global_key_value_heads") or next((p["num_key_value_heads"] for p in full
                                                        if "num_key_value_heads" in p), None)
    return int(dim), kv


def rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's rope_freqs for full layers: 1 on the turned frequency pairs, 1e30 on the rest."""
    dim, _ = _full_shape(cfg)
    turned = int(dim * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turned + [1e30] * (dim // 2 - turned), dtype=np.float32)


def _metadata(w, cfg: dict) -> None:
    """Gemma3Model's keys and Gemma4Model's on top (set_gguf_parameters), in the converter's order."""
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    dim, kv_full = _full_shape(cfg)
    rope = cfg["rope_parameters"]
    ff, first_shared = cfg["intermediate_size"], n - (cfg.get("num_kv_shared_layers") or 0)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    # one width a layer where the KV-shared layers' MLP is double-wide
    w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)]
                              if cfg.get("use_double_wide_mlp") else ff)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(cfg.get("num_kv_shared_layers") or 0)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_key_length(dim)
    w.add_value_length(dim)
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    kv = cfg["num_key_value_heads"]
    w.add_head_count_kv(kv if kv_full is None else [kv if t == "sliding_attention" else kv_full for t in types])
    w.add_rope_dimension_count(dim)
    w.add_rope_dimension_count_swa(int(cfg["head_dim"] * rope["sliding_attention"].get("partial_rotary_factor", 1.0)))


def contract_state_dict(hf_sd: dict) -> dict:
    """transformers' Gemma4ForCausalLM state dict under tandem's contract names (model/gemma4_config.py): the router
    and the experts under moe., the fused gate_up_proj split per expert (gate: the first I rows), lm_head dropped
    (tied)."""
    out = {}
    for name, t in hf_sd.items():
        if name == "lm_head.weight":
            continue
        prefix, _, rest = name.partition(".router.") if ".router." in name else name.partition(".experts.")
        if not rest:
            out[name] = t
        elif ".router." in name:
            out[f"{prefix}.moe." + {"proj.weight": "gate.weight", "scale": "router_scale",
                                    "per_expert_scale": "per_expert_scale"}[rest]] = t
        elif rest == "gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.moe.experts.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.moe.experts.{e}.up_proj.weight"] = t[e, half:]
        else:
            out.update({f"{prefix}.moe.experts.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
    return out


# llama.cpp's source as tandem.bench builds its tools from (or $TANDEM_LLAMA_CPP_SRC): the converter test skips
# where it is absent
LLAMA_CPP = os.environ.get("TANDEM_LLAMA_CPP_SRC") or os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem", "llamacpp", "llama_cpp_python-0.3.36",
    "vendor", "llama.cpp")
# Gemma4Model.set_vocab wants Gemma's own tokenizer (a Llama-style BPE); the tiny models carry SmolLM2's, which
# the gemma3 path (a GPT-2 BPE) reads. Nothing else of the converter is changed.
_CONVERT = ("import sys; sys.path.insert(0, {root!r}); sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[1:]\n"
            "import convert_hf_to_gguf as c\nfrom conversion import gemma\n"
            "gemma.Gemma4Model.set_vocab = lambda self: self._set_vocab_gpt2()\nc.main()\n")


def convert_with_llama_cpp(hf_dir: str, out: str, outtype: str = "f32", root: str = LLAMA_CPP) -> str:
    """Run llama.cpp's own convert_hf_to_gguf.py on hf_dir (offline; its gguf-py), as the reference file."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _CONVERT.format(root=root), hf_dir, "--outfile", out,
                    "--outtype", outtype], check=True, capture_output=True, cwd=root)
    return out
