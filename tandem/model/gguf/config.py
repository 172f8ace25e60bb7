"""A llama.cpp GGUF file's metadata as tandem's ModelConfig, and its tensor names as Hugging Face's.

What each architecture's keys mean (llama, mistral, qwen2, qwen3, gemma3) and what llama.cpp leaves out of
the file (gemma3's layer pattern and local RoPE base) live here, gemma4's in gemma4.py; weights.py reads the
weights and the tokenizer, cache.py caches the config and tokenizer.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..config import SUPPORTED_HF_ARCHITECTURES, ModelConfig
from .gemma4 import GEMMA4_BLOCK_NAMES, GEMMA4_GLOBAL_NAMES, gemma4_switches, unsupported_tensor

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen35", "qwen35moe",
                                "qwen3next", "gpt-oss", "gemma4")
_ARCHITECTURE = {"mistral": "llama", "qwen3moe": "qwen3_moe",     # GGUF general.architecture -> ModelConfig's
                 "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next", "gpt-oss": "gpt_oss"}
HYBRID_GGUF = ("qwen35", "qwen35moe", "qwen3next")
STACKED = (".experts.gate_proj.weight", ".experts.up_proj.weight", ".experts.down_proj.weight")  # 3-D blocks
STACKED_BIAS = (".experts.gate_proj.bias", ".experts.up_proj.bias", ".experts.down_proj.bias")    # gpt-oss: [E, n]
# llama.cpp hard-codes what gemma3 GGUF files do not store: every 6th layer global, local RoPE base 10k.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",                   # the router [E, hidden], F32 in llama.cpp's files
    "ffn_gate_exps.weight": "mlp" + STACKED[0],                 # [E, I, hidden]: split per expert at load
    "ffn_up_exps.weight": "mlp" + STACKED[1],
    "ffn_down_exps.weight": "mlp" + STACKED[2],
}
# The hybrids' tensors as llama.cpp's converter writes them (A as -exp(A_log), dt_bias as ssm_dt.bias, the conv
# squeezed to [C, width], Qwen3-Next's in_proj_ba as ssm_ba); their norm after attention is the pre-MLP norm.
_HYBRID_BLOCK_NAMES = {**_BLOCK_NAMES,
                       "post_attention_norm.weight": "post_attention_layernorm.weight",
                       "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
                       "attn_gate.weight": "linear_attn.in_proj_z.weight",
                       "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                       "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
                       "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
                       "ssm_conv1d.weight": "linear_attn.conv1d.weight",
                       "ssm_dt.bias": "linear_attn.dt_bias",
                       "ssm_a": "linear_attn.A_log",
                       "ssm_norm.weight": "linear_attn.norm.weight",
                       "ssm_out.weight": "linear_attn.out_proj.weight",
                       "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                       "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                       "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                       "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# gpt-oss's (llama.cpp's converter): the pre-MLP norm as post_attention_norm, the sinks, o's, the router's and the
# experts' biases (the experts' weights MXFP4 where the checkpoint was)
_GPT_OSS_BLOCK_NAMES = {**_BLOCK_NAMES,
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "attn_sinks.weight": "self_attn.sinks",
                        "attn_output.bias": "self_attn.o_proj.bias",
                        "ffn_gate_inp.bias": "mlp.gate.bias",
                        "ffn_gate_exps.bias": "mlp" + STACKED_BIAS[0],
                        "ffn_up_exps.bias": "mlp" + STACKED_BIAS[1],
                        "ffn_down_exps.bias": "mlp" + STACKED_BIAS[2]}
_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")     # the older layout: one tensor per expert
# gemma3's sandwich norms: llama.cpp's ffn_norm is the pre-MLP norm, post_attention_norm the one after attention.
_GEMMA3_BLOCK_NAMES = {**_BLOCK_NAMES,
                       "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                       "post_attention_norm.weight": "post_attention_layernorm.weight",
                       "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF state-dict key for a GGUF tensor name of architecture `arch` (None for tensors we drop)."""
    if name in _IGNORED or re.match(r"^blk\.\d+\.attn_rot_embd$", name):
        return None
    glob = {**_GLOBAL_NAMES, **GEMMA4_GLOBAL_NAMES} if arch == "gemma4" else _GLOBAL_NAMES
    if name in glob:
        return glob[name]
    m = _BLK_RE.match(name)
    names = {"gemma3": _GEMMA3_BLOCK_NAMES, "qwen3_5": _HYBRID_BLOCK_NAMES, "qwen3_5_moe": _HYBRID_BLOCK_NAMES,
             "qwen3_next": _HYBRID_BLOCK_NAMES, "gpt_oss": _GPT_OSS_BLOCK_NAMES,
             "gemma4": GEMMA4_BLOCK_NAMES}.get(arch, _BLOCK_NAMES)
    if m and arch == "gemma4" and unsupported_tensor(m.group(2)):
        raise ValueError(f"gemma4: {unsupported_tensor(m.group(2))} ({name!r}) is not supported")
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e:
        return f"model.layers.{m.group(1)}.mlp.experts.{e.group(2)}.{e.group(1)}_proj.weight"
    raise ValueError(f"unexpected tensor {name!r} in GGUF file")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's convert-time q/k row permutation.

    llama.cpp: ``w.reshape(n_head, 2, rows//n_head//2, *rest).swapaxes(1, 2).reshape(w.shape)``
    (HF's rotate-half layout -> interleaved pairs); this maps it back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute tensor with {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def get_field(reader, key: str, default=None):
    return reader.field(key, default)


def _f32(x) -> float:
    """Shortest decimal that round-trips a float32 metadata value (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _llama3_rope_scaling(freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover the HF llama3 rope_scaling dict from llama.cpp's rope_freqs tensor."""
    factor = float(freqs.max())
    cand = {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old = cand["original_max_position_embeddings"]
    lo_wl, hi_wl = old / cand["low_freq_factor"], old / cand["high_freq_factor"]
    expect = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            expect.append(1.0)
        elif wl > lo_wl:
            expect.append(factor)
        else:
            s = (old / wl - cand["low_freq_factor"]) / (cand["high_freq_factor"] - cand["low_freq_factor"])
            expect.append(1 / ((1 - s) / factor + s))
    if freqs.shape != (head_dim // 2,) or not np.allclose(freqs, expect, rtol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 RoPE scaling with "
                         "low_freq_factor=1, high_freq_factor=4, original context 8192")
    return cand


def read_gguf_config(reader) -> ModelConfig:
    arch = get_field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} "
                         f"(HF: {', '.join(SUPPORTED_HF_ARCHITECTURES)})")

    def req(key: str):
        v = get_field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF file is missing metadata key {arch}.{key!s}")
        return v

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = get_field(reader, f"{arch}.attention.head_count_kv", n_head)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)       # gemma4: one a layer (its switches say which)
    head_dim = int(get_field(reader, f"{arch}.attention.key_length", 0)
                   or get_field(reader, f"{arch}.rope.dimension_count", 0) or hidden // n_head)
    vocab = get_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = reader.count("tokenizer.ggml.tokens") or int(tensors["token_embd.weight"].shape[0])
    rope_theta = _f32(get_field(reader, f"{arch}.rope.freq_base", 10000.0))

    scaling = None
    stype = get_field(reader, f"{arch}.rope.scaling.type")
    if stype in ("linear", "yarn"):
        scaling = {"rope_type": stype, "factor": _f32(req("rope.scaling.factor"))}
        orig = get_field(reader, f"{arch}.rope.scaling.original_context_length")
        if stype == "yarn" and orig:
            scaling["original_max_position_embeddings"] = int(orig)
        if stype == "yarn" and arch == "gpt-oss":      # its config's ramp (not in the file): 32 / 1, not rounded
            scaling.update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    elif stype not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {stype!r}")
    elif get_field(reader, f"{arch}.rope.scale_linear") not in (None, 1.0):
        scaling = {"rope_type": "linear", "factor": _f32(get_field(reader, f"{arch}.rope.scale_linear"))}
    if "rope_freqs.weight" in tensors and arch != "gemma4":     # gemma4's: its full layers' proportional RoPE
        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(dequantize_f32(t), dtype=np.float64).reshape(-1)
        scaling = _llama3_rope_scaling(freqs, rope_theta, head_dim)

    # the hybrids' files count their multi-token-prediction layers as blocks too (not served: gguf_to_hf_name)
    num_layers = int(req("block_count")) - int(get_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    extra = _arch_switches(reader, arch, tensors, num_layers, head_dim)
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = get_field(reader, key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = get_field(reader, "tokenizer.ggml.bos_token_id")

    ff = get_field(reader, f"{arch}.feed_forward_length", 0)
    kw = dict(
        architecture=_ARCHITECTURE.get(arch, arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int((ff[0] if isinstance(ff, list) else ff)       # gemma4: one a layer
                              or get_field(reader, f"{arch}.expert_feed_forward_length", 0)
                              or req("feed_forward_length")),
        num_layers=num_layers,
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=_f32(req("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )
    kw.update(extra)                    # gemma4's head_dim / num_kv_heads / intermediate_size are its sliding layers'
    return ModelConfig(**kw)


def _arch_switches(reader, arch: str, tensors: dict, num_layers: int, head_dim: int) -> dict:
    """The ModelConfig switches of a GGUF architecture beyond llama's (see ModelConfig)."""
    window = get_field(reader, f"{arch}.attention.sliding_window")
    out: dict = {}
    if "blk.0.attn_q_norm.weight" in tensors:
        out["qk_norm"] = True
    if arch == "gemma3":
        pattern = get_field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, list):           # newer llama.cpp: one bool per layer, True = sliding
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)]
        if window is None:
            raise ValueError("GGUF file is missing metadata key gemma3.attention.sliding_window")
        local_theta = _f32(get_field(reader, f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
        out.update(sliding_window=int(window), layer_types=tuple(types), rope_local_theta=local_theta,
                   norm_offset=1.0, sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True,
                   query_pre_attn_scalar=float(head_dim))
    elif window and arch in ("mistral", "llama"):
        out["sliding_window"] = int(window)
    elif arch in HYBRID_GGUF:
        out.update(_linear_attention(reader, arch, tensors, num_layers, head_dim))
    elif arch == "gemma4":
        t = tensors.get("rope_freqs.weight")
        freqs = None if t is None else np.asarray(dequantize_f32(t), dtype=np.float64).reshape(-1)
        out.update(gemma4_switches(lambda k, d=None: get_field(reader, f"{arch}.{k}", d), tensors, num_layers, freqs))
    elif arch == "gpt-oss":
        # llama.cpp: sliding layers first, then every other one (its swa pattern 2); the rest as HF's config
        out.update(sliding_window=int(window or 128), attention_sinks=True, attention_out_bias=True, moe_bias=True,
                   layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(num_layers)),
                   moe_routing="topk_softmax", hidden_act="swiglu_oai")
    out.update(_experts(reader, arch, tensors, num_layers))
    if arch == "gpt-oss":
        out["norm_topk_prob"] = False           # the softmax over the top-k already sums to 1
    if arch == "gemma4" and out.get("num_experts"):      # beside the dense MLP; the top-k renormalized (as HF's)
        out.update(moe_beside_mlp=True, norm_topk_prob=True)
    return out


def _linear_attention(reader, arch: str, tensors: dict, num_layers: int, head_dim: int) -> dict:
    """A hybrid's switches from its ssm.* keys (state_size: a key head's dim; group_count: key heads;
    time_step_rank: value heads; inner_size: value heads x their dim), its linear layers (those with ssm_a), the
    rotary dims, and the value-head order: Qwen3.5's converter tiles value heads over the key heads (value head h
    reads key head h mod key heads), Qwen3-Next's keeps them grouped (h div value heads per key head)."""
    def req(key: str):
        v = get_field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF file is missing metadata key {arch}.{key}")
        return int(v)

    hv = req("ssm.time_step_rank")
    types = tuple("linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention" for i in range(num_layers))
    rotary = int(get_field(reader, f"{arch}.rope.dimension_count", 0) or head_dim)
    return dict(qk_norm=True, norm_offset=1.0, attn_output_gate=True, layer_types=types,
                linear_num_key_heads=req("ssm.group_count"), linear_num_value_heads=hv,
                linear_key_head_dim=req("ssm.state_size"), linear_value_head_dim=req("ssm.inner_size") // hv,
                linear_conv_kernel=req("ssm.conv_kernel"), partial_rotary_factor=rotary / head_dim,
                linear_value_heads_tiled=arch != "qwen3next",
                shared_expert_intermediate_size=int(get_field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
                                                    or 0))


def _experts(reader, arch: str, tensors: dict, num_layers: int) -> dict:
    """The expert switches ({arch}.expert_count, expert_used_count, expert_feed_forward_length): qwen3moe, or
    llama with expert tensors (Mixtral). Layers without a router (ffn_gate_inp) keep a dense MLP. llama.cpp
    renormalizes the chosen experts' weights for both (expert_weights_norm where a file says otherwise)."""
    n = get_field(reader, f"{arch}.expert_count")
    if not n:
        if arch in ("qwen3moe", "qwen35moe"):
            raise ValueError("GGUF file is missing metadata key qwen3moe.expert_count")
        return {}
    used = get_field(reader, f"{arch}.expert_used_count")
    if not used:
        raise ValueError(f"GGUF file is missing metadata key {arch}.expert_used_count")
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    return dict(num_experts=int(n), num_experts_per_tok=int(used), mlp_only_layers=dense,
                moe_intermediate_size=int(get_field(reader, f"{arch}.expert_feed_forward_length", 0) or 0),
                norm_topk_prob=bool(get_field(reader, f"{arch}.expert_weights_norm", True)))


def dequantize_f32(t) -> np.ndarray:
    """fp32 of a GGUFTensor, numpy-shaped; F32 stays a view of the file's map (copy-on-write)."""
    if t.qtype == 0:
        return t.data.view(np.float32).reshape(t.shape)
    from gguf.quants import dequantize

    return dequantize(t.data, t.qtype).reshape(t.shape)
