"""Hugging Face config.json -> ModelConfig's fields: the architectures tandem serves, their defaults, and the switches
each implies. config.py holds the record; this file reads the one format that names architectures by class."""
from __future__ import annotations

import logging
from typing import Any

from .gemma4_config import GEMMA4_DEFAULTS, hf_gemma4

log = logging.getLogger(__name__)

# HF "architectures" entry -> our architecture name. A ...ForConditionalGeneration checkpoint (Qwen3.5 with its
# vision tower) serves its language model: text_config and the model.language_model.* weights.
SUPPORTED_HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
}
# HF model_type -> our architecture name (a config.json without "architectures").
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                   "gemma3_text": "gemma3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
                   "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
                   "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next",
                   "gpt_oss": "gpt_oss", "gemma4_text": "gemma4", "gemma4": "gemma4"}
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(SUPPORTED_HF_ARCHITECTURES.values()))
# Hybrids: Gated DeltaNet layers (layer_types "linear_attention") between gated full-attention layers.
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_VISION_WRAPPERS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                    "Gemma4ForConditionalGeneration")

_QWEN = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
# Defaults of the HF config classes for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": _QWEN, "qwen3": _QWEN, "qwen3_moe": _QWEN, "qwen3_5": _QWEN, "qwen3_5_moe": _QWEN, "qwen3_next": _QWEN,
    "mistral": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
    "gemma3": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
               "rope_local_theta": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 6},
    "mixtral": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "gemma4": GEMMA4_DEFAULTS,
    "gpt_oss": {"rope_theta": 150_000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "sliding_window": 128},
}
# rope_parameters keys that are not a scaling: the partial rotary share, and Qwen3.5's multimodal sections (text
# alone gives every section the same position, so MRoPE is plain RoPE there)
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def unsupported(what: str) -> ValueError:
    names = ", ".join(SUPPORTED_HF_ARCHITECTURES)
    return ValueError(f"unsupported model architecture {what}; supported architectures: {names} "
                      f"(GGUF: {', '.join(SUPPORTED_ARCHITECTURES)})")


def hf_config_kwargs(d: dict) -> dict[str, Any]:
    """ModelConfig's fields from a Hugging Face config.json dict (transformers 4 or 5 layout)."""
    d = _text_config(d)
    arch = _hf_architecture(d)

    def req(key: str) -> Any:
        if d.get(key) is None:
            raise ValueError(f"config.json is missing required key {key!r} (architecture {arch})")
        return d[key]

    _reject_unsupported_hf_options(d, arch)
    defaults = _HF_DEFAULTS[arch]
    hidden = int(req("hidden_size"))
    num_heads = int(req("num_attention_heads"))
    num_layers = int(req("num_hidden_layers"))
    rope_theta, scaling, local_params = _hf_rope(d, defaults)
    bos = d.get("bos_token_id")
    window, layer_types = _sliding(arch, d, num_layers, defaults)
    out = dict(
        architecture=arch,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(req("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or hidden // num_heads),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
        max_position_embeddings=int(d.get("max_position_embeddings") or defaults["max_position_embeddings"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_hf_eos_ids(d),
        sliding_window=window,
        layer_types=layer_types,
    )
    out.update(_hf_arch_switches(arch, d, defaults, local_params))     # gemma4's own RoPE, window and layer types
    return out


def _text_config(d: dict) -> dict:
    """A vision-language wrapper's text model: its text_config, with the wrapper's architecture and the keys it
    keeps at the top (tied embeddings). The vision tower is not served (its weights are skipped at load)."""
    archs = d.get("architectures") or []
    if not any(a in _VISION_WRAPPERS for a in archs) or not isinstance(d.get("text_config"), dict):
        return d
    log.info("%s: serving its language model; the vision tower is ignored", archs[0])
    out = {**d["text_config"], "architectures": archs}
    if "tie_word_embeddings" in d:
        out["tie_word_embeddings"] = d["tie_word_embeddings"]
    return out


def _hf_architecture(d: dict) -> str:
    """Our architecture name from an HF config's "architectures" list, else from its model_type."""
    archs = d.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_HF_ARCHITECTURES:
            return SUPPORTED_HF_ARCHITECTURES[a]
    if archs:
        raise unsupported(", ".join(map(repr, archs)))
    if d.get("model_type") in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[d["model_type"]]
    raise unsupported(f"(no 'architectures'; model_type={d.get('model_type')!r})")


def _reject_unsupported_hf_options(d: dict, arch: str) -> None:
    """HF options the one decoder does not implement: an error rather than a silently different model."""
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None and not (arch == "gemma4" and key == "final_logit_softcapping"):
            raise ValueError(f"{key}={d[key]} is not supported (gemma2-style soft-capping)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (a causal LM only)")


def _hf_rope(d: dict, defaults: dict) -> tuple[Any, dict | None, dict | None]:
    """(rope_theta, normalized rope_scaling, the sliding layers' rope parameters or None) of an HF config.

    transformers 5 folds rope_theta and rope_scaling into "rope_parameters"; gemma3 keeps one dict per
    layer type there ("full_attention", "sliding_attention")."""
    rope_params = dict(d.get("rope_parameters") or {})
    local_params = None
    if "full_attention" in rope_params or "sliding_attention" in rope_params:
        local_params = dict(rope_params.get("sliding_attention") or {})
        rope_params = dict(rope_params.get("full_attention") or {})
    rope_theta = d.get("rope_theta", rope_params.get("rope_theta", defaults["rope_theta"]))
    scaling = d.get("rope_scaling")
    if scaling is None and rope_params:
        scaling = {k: v for k, v in rope_params.items() if k not in _NOT_SCALING}
    return rope_theta, _normalize_rope_scaling(scaling), local_params


def _hf_eos_ids(d: dict) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        return tuple(int(i) for i in eos)
    return (int(eos),)


def _hf_arch_switches(arch: str, d: dict, defaults: dict, local_params: dict | None) -> dict[str, Any]:
    """The ModelConfig switches an architecture implies (qk_norm; gemma3's norms, activation, local RoPE base,
    embedding scale and attention scale), after checking its activation is the one the decoder implements."""
    extra: dict[str, Any] = _hf_experts(arch, d)
    if arch in ("qwen3", "gemma3", "qwen3_moe", *HYBRID_ARCHITECTURES):
        extra["qk_norm"] = True
    if arch in HYBRID_ARCHITECTURES:
        extra.update(_hf_linear_attention(d))
    if arch == "gpt_oss":
        extra.update(_hf_gpt_oss(d))
        return extra
    if arch == "gemma4":
        extra.update(hf_gemma4(d, int(d["num_hidden_layers"])))
        return extra
    if arch == "gemma3":
        local_theta = d.get("rope_local_base_freq", (local_params or {}).get("rope_theta"))
        if _normalize_rope_scaling({k: v for k, v in (local_params or {}).items() if k != "rope_theta"}):
            raise ValueError("gemma3: rope scaling on sliding layers is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"gemma3: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        extra.update(rope_local_theta=float(local_theta or defaults["rope_local_theta"]), norm_offset=1.0,
                     sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True,
                     query_pre_attn_scalar=float(d.get("query_pre_attn_scalar")
                                                 or defaults["query_pre_attn_scalar"]))
    else:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{arch}: hidden_act {act!r} is not supported (silu)")
    return extra


def _hf_gpt_oss(d: dict) -> dict[str, Any]:
    """gpt-oss's switches: a learned sink logit per head in every softmax, an output bias on o_proj, the router's
    bias with the softmax over the chosen experts' logits, every expert's biases and its clamped SwiGLU (whatever
    hidden_act says: transformers' experts ignore it)."""
    if d.get("attention_bias") is False:
        raise ValueError("gpt_oss: attention_bias=False is not supported (its attention has q / k / v / o biases)")
    return dict(attention_sinks=True, attention_out_bias=True, moe_bias=True, moe_routing="topk_softmax",
                hidden_act="swiglu_oai", swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)))


def _hf_experts(arch: str, d: dict) -> dict[str, Any]:
    """The expert switches of an MoE config (qwen3_moe, mixtral); transformers 5 writes qwen3_moe's num_experts
    as num_local_experts."""
    if arch not in ("qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_next", "gpt_oss"):
        return {}
    n = d.get("num_experts") or d.get("num_local_experts")
    if arch == "qwen3_next" and not n:
        return {}                       # a dense Qwen3-Next
    if not n or not d.get("num_experts_per_tok"):
        raise ValueError(f"{arch}: config.json needs num_experts (or num_local_experts) and num_experts_per_tok")
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    if shared and arch in ("qwen3_moe", "mixtral"):
        raise ValueError(f"{arch}: shared experts are not supported")
    out = dict(num_experts=int(n), num_experts_per_tok=int(d["num_experts_per_tok"]),
               shared_expert_intermediate_size=shared)
    if arch == "gpt_oss":               # the softmax runs over the top-k: their weights sum to 1 as they are
        out.update(moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=False)
    elif arch != "mixtral":
        # Qwen3.5-MoE always renormalizes its top-k (its config has no norm_topk_prob); Qwen3-Next by default
        out.update(moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
                   norm_topk_prob=bool(d.get("norm_topk_prob", arch != "qwen3_moe")),
                   decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
    return out


def _hf_linear_attention(d: dict) -> dict[str, Any]:
    """A hybrid's switches: its Gated DeltaNet heads and conv width, the (1 + w) norms, the gated attention output
    and the partial rotary share (rope_parameters in transformers 5; top-level before)."""
    rope = d.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    need = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    missing = [k for k in need if not d.get(k)]
    if missing:
        raise ValueError(f"config.json of a hybrid linear-attention model is missing {', '.join(missing)}")
    return dict(linear_num_key_heads=int(d["linear_num_key_heads"]),
                linear_num_value_heads=int(d["linear_num_value_heads"]),
                linear_key_head_dim=int(d["linear_key_head_dim"]),
                linear_value_head_dim=int(d["linear_value_head_dim"]),
                linear_conv_kernel=int(d.get("linear_conv_kernel_dim") or 4),
                partial_rotary_factor=float(factor), attn_output_gate=True, norm_offset=1.0)


def _sliding(arch: str, d: dict, num_layers: int, defaults: dict) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of an HF config: mistral slides every layer when sliding_window is set;
    qwen2/qwen3 only with use_sliding_window (layers from max_window_layers on); gemma3 interleaves by
    layer_types (or its sliding_window_pattern: every 6th layer global)."""
    window = d.get("sliding_window")
    if arch == "gemma3":
        window = int(window or defaults["sliding_window"])
        types = d.get("layer_types")
        if types is None:
            pattern = int(d.get("sliding_window_pattern") or defaults["sliding_window_pattern"])
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        return window, tuple(types)
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        if not d.get("use_sliding_window") or not window:
            return None, None
        types = d.get("layer_types") or ["sliding_attention" if i >= int(d.get("max_window_layers") or 0)
                                         else "full_attention" for i in range(num_layers)]
        return int(window), tuple(types)
    if arch in ("mistral", "mixtral") and window:
        return int(window), None
    if arch == "gpt_oss":                     # sliding and full layers alternate, the first sliding
        types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(num_layers)]
        return int(window or defaults["sliding_window"]), tuple(types)
    if arch in HYBRID_ARCHITECTURES:          # three linear-attention layers to one full, unless it lists them
        every = int(d.get("full_attention_interval") or 4)
        types = d.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                         for i in range(num_layers)]
        return None, tuple(types)
    return None, None


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """HF rope_scaling with a "rope_type" key, or None for plain RoPE."""
    if not scaling:
        return None
    s = dict(scaling)
    if "rope_type" not in s and "type" in s:
        s["rope_type"] = s["type"]
    s.pop("type", None)
    for k in _NOT_SCALING:
        s.pop(k, None)
    if s.get("rope_type") in (None, "default"):
        return None
    return s

