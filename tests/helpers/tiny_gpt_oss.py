"""make_tiny_gpt_oss: a tiny random gpt-oss (transformers' GptOssForCausalLM) with SmolLM2's tokenizer, saved as
transformers saves it (stacked, interleaved experts; the router's and every expert's biases; the sinks), every
bias, norm, sink and router weight randomized so that each of them changes the output."""
from __future__ import annotations

import json
import os

import torch

from tests.helpers.tiny_models import smollm2_tokenizer

# 4 layers alternating sliding (window 8) and full attention, 8 experts top-2, YaRN as gpt-oss sets it
GPT_OSS = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
               rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0})


def make_tiny_gpt_oss(tmp_dir, *, seed: int = 0, cache_dir: str | None = None, **overrides) -> str:
    from transformers import GptOssConfig, GptOssForCausalLM
    tok = smollm2_tokenizer(cache_dir)
    config = GptOssConfig(**{**GPT_OSS, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                             "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **overrides})
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "_bias")) or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):                 # around the scores' own size: some heads sink a lot
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("router.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "experts" in name:                      # large enough that the SwiGLU's clamp takes some values
                p.copy_(0.6 * torch.randn(p.shape, generator=gen))
    os.makedirs(tmp_dir, exist_ok=True)
    model.save_pretrained(str(tmp_dir))
    tok.save_pretrained(str(tmp_dir))
    return str(tmp_dir)


def write_gpt_oss_gguf(path, hf_dir: str, mxfp4: bool = True, with_tokenizer: bool = False) -> str:
    """The tiny gpt-oss as llama.cpp's converter writes it: arch "gpt-oss", the experts split into gate / up /
    down 3-D blocks ([E, out, in]) and their biases [E, out], the sinks as attn_sinks.weight, the pre-MLP norm as
    post_attention_norm, YaRN's factor and original context; the experts in MXFP4 (as the converter repacks an
    MXFP4 checkpoint's) or F32, every other tensor F32. Returns the path."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.helpers.tiny_models import _add_tokenizer
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    rope = cfg["rope_parameters"]
    for add, v in ((w.add_block_count, cfg["num_hidden_layers"]), (w.add_context_length, cfg["max_position_embeddings"]),
                   (w.add_embedding_length, cfg["hidden_size"]), (w.add_feed_forward_length, cfg["intermediate_size"]),
                   (w.add_head_count, cfg["num_attention_heads"]), (w.add_head_count_kv, cfg["num_key_value_heads"]),
                   (w.add_rope_freq_base, float(rope["rope_theta"])), (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
                   (w.add_key_length, cfg["head_dim"]), (w.add_value_length, cfg["head_dim"]),
                   (w.add_expert_count, cfg["num_local_experts"]), (w.add_expert_used_count, cfg["num_experts_per_tok"]),
                   (w.add_expert_feed_forward_length, cfg["intermediate_size"]),
                   (w.add_sliding_window, cfg["sliding_window"]), (w.add_rope_scaling_factor, rope["factor"]),
                   (w.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"])):
        add(v)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    _add_tokenizer(w, cfg, with_tokenizer)
    for name, t in sd.items():
        for gname, a in _converted(name, np.asarray(t, dtype=np.float32)):
            if mxfp4 and gname.endswith("_exps.weight"):
                q = gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.MXFP4)
                w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            else:
                w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
          **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
          **{f"self_attn.o_proj.{k}": f"attn_output.{k}" for k in ("weight", "bias")}}


def _converted(name: str, t):
    """[(GGUF name, array)] of one checkpoint tensor, as the converter splits and transposes it."""
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if name in glob:
        return [(glob[name], t)]
    parts = name.split(".")
    prefix, rest = f"blk.{parts[2]}.", ".".join(parts[3:])
    if rest == "mlp.experts.gate_up_proj":                 # [E, in, 2 out] interleaved -> gate, up [E, out, in]
        t = t.transpose(0, 2, 1)
        return [(prefix + "ffn_gate_exps.weight", t[:, 0::2]), (prefix + "ffn_up_exps.weight", t[:, 1::2])]
    if rest == "mlp.experts.gate_up_proj_bias":
        return [(prefix + "ffn_gate_exps.bias", t[:, 0::2]), (prefix + "ffn_up_exps.bias", t[:, 1::2])]
    if rest == "mlp.experts.down_proj":
        return [(prefix + "ffn_down_exps.weight", t.transpose(0, 2, 1))]
    return [(prefix + _NAMES[rest], t)]


def save_mxfp4_checkpoint(hf_dir: str, out_dir) -> str:
    """The tiny model's checkpoint as openai/gpt-oss ships it: every expert tensor as `*_blocks` (uint8 [E, out,
    in / 32, 16], the even element in a byte's low nibble) and `*_scales` (its E8M0 exponents), quantized by gguf-py's
    MXFP4; config.json with its quantization_config; the rest as it is."""
    import shutil

    import gguf
    import numpy as np
    from safetensors.numpy import load_file, save_file
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(hf_dir):
        if f != "model.safetensors":
            shutil.copy(os.path.join(hf_dir, f), os.path.join(out_dir, f))
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = np.ascontiguousarray(sd.pop(name).transpose(0, 2, 1))            # [E, out, in]
        q = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4)         # [E, out, in / 32 * 17]
        q = q.reshape(*rows.shape[:2], -1, 17)
        e, qs = q[..., 0], q[..., 1:]
        nib = np.concatenate([qs & 15, qs >> 4], axis=-1)                       # element order
        sd[name + "_blocks"] = np.ascontiguousarray(nib[..., 0::2] | (nib[..., 1::2] << 4))
        sd[name + "_scales"] = np.ascontiguousarray(e)
    save_file(sd, os.path.join(out_dir, "model.safetensors"))
    return str(out_dir)
