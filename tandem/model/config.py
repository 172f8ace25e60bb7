"""Model hyper-parameters, independent of where the weights came from."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

# HF "architectures" entry -> our architecture name.
SUPPORTED_HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# HF model_type -> our architecture name (a config.json without "architectures").
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                   "gemma3_text": "gemma3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(SUPPORTED_HF_ARCHITECTURES.values())

# Defaults of the HF config classes for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "mistral": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
    "gemma3": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
               "rope_local_theta": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 6},
    "qwen3_moe": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "mixtral": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
}


def _unsupported(what: str) -> ValueError:
    names = ", ".join(SUPPORTED_HF_ARCHITECTURES)
    return ValueError(f"unsupported model architecture {what}; supported architectures: {names} "
                      f"(GGUF: {', '.join(SUPPORTED_ARCHITECTURES)})")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder; architectures differ only by the switches below (read from config.json or GGUF metadata).

    llama / mistral: the defaults (mistral may set sliding_window). qwen2: attention_bias. qwen3: qk_norm.
    gemma3: qk_norm, sandwich_norm, norm_offset 1, gelu_tanh, embed_scale, query_pre_attn_scalar, and
    sliding layers (layer_types) with their own RoPE base (rope_local_theta). qwen3_moe: qk_norm and experts
    (num_experts > 0: a router picks num_experts_per_tok of them per token in place of the dense MLP, except in
    the mlp_only_layers and the layers decoder_sparse_step skips). mixtral: experts in every layer (and, from a
    GGUF, llama with expert tensors)."""
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # True for qwen2 (q/k/v bias)
    rope_scaling: dict | None = None  # HF rope_scaling dict (with "rope_type"); None if absent
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False            # RMSNorm over head_dim on q and k before RoPE (qwen3, gemma3)
    sliding_window: int | None = None    # keys a sliding layer sees, its own included (k > q - W); None: none
    layer_types: tuple[str, ...] | None = None   # per layer, one of LAYER_TYPES; None: all sliding if a window
    rope_local_theta: float | None = None    # RoPE base of sliding layers (gemma3); None: rope_theta
    norm_offset: float = 0.0         # RMSNorm applies (norm_offset + w): gemma's (1 + w)
    sandwich_norm: bool = False      # norms after attention and after the MLP too (gemma3)
    hidden_act: str = "silu"         # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False        # embeddings times sqrt(hidden_size) (gemma)
    query_pre_attn_scalar: float | None = None   # attention scale is its -1/2 power; None: head_dim
    num_experts: int = 0             # experts of an MoE layer; 0: a dense model
    num_experts_per_tok: int = 0     # experts each token runs (top-k of the router's softmax)
    moe_intermediate_size: int = 0   # an expert's gated-MLP width; 0: intermediate_size (mixtral)
    norm_topk_prob: bool = True      # the chosen experts' weights renormalized to sum 1 (mixtral: always)
    decoder_sparse_step: int = 1     # layer i has experts when (i + 1) % step == 0 (qwen3_moe)
    mlp_only_layers: tuple[int, ...] = ()   # layers that keep the dense MLP (intermediate_size) all the same

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(repr(self.architecture))
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if not isinstance(self.eos_token_ids, tuple):
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer ({self.num_layers}), "
                                 f"got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu, gelu_tanh)")
        self._check_experts()

    def _check_experts(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok!r}")
        if self.moe_intermediate_size < 0 or self.decoder_sparse_step < 1:
            raise ValueError(f"moe_intermediate_size ({self.moe_intermediate_size}) must be >= 0 and "
                             f"decoder_sparse_step ({self.decoder_sparse_step}) >= 1")
        if not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)

    def is_moe(self, layer: int) -> bool:
        """Whether `layer` runs experts (a router and num_experts gated MLPs) in place of the dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends only its last sliding_window keys."""
        if not self.sliding_window:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int:
        """Keys layer `layer` sees back from the query (its own included); 0: all of them."""
        return self.sliding_window if self.is_sliding(layer) else 0

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4 or 5 layout)."""
        arch = _hf_architecture(d)

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"config.json is missing required key {key!r} (architecture {arch})")
            return d[key]

        _reject_unsupported_hf_options(d)
        defaults = _HF_DEFAULTS[arch]
        hidden = int(req("hidden_size"))
        num_heads = int(req("num_attention_heads"))
        num_kv = int(d.get("num_key_value_heads") or num_heads)
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        num_layers = int(req("num_hidden_layers"))
        rope_theta, scaling, local_params = _hf_rope(d, defaults)
        eos_ids = _hf_eos_ids(d)
        bos = d.get("bos_token_id")
        window, layer_types = _sliding(arch, d, num_layers, defaults)
        extra = _hf_arch_switches(arch, d, defaults, local_params)
        return cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
            max_position_embeddings=int(d.get("max_position_embeddings")
                                        or defaults["max_position_embeddings"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_types=layer_types,
            **extra,
        )

    # ------------------------------------------------------------ plain data
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["eos_token_ids"] = tuple(int(i) for i in kw.get("eos_token_ids") or ())
        kw["mlp_only_layers"] = tuple(int(i) for i in kw.get("mlp_only_layers") or ())
        if kw.get("rope_scaling") is not None:
            kw["rope_scaling"] = copy.deepcopy(dict(kw["rope_scaling"]))
        return cls(**kw)


def _hf_architecture(d: dict) -> str:
    """Our architecture name from an HF config's "architectures" list, else from its model_type."""
    archs = d.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_HF_ARCHITECTURES:
            return SUPPORTED_HF_ARCHITECTURES[a]
    if archs:
        raise _unsupported(", ".join(map(repr, archs)))
    if d.get("model_type") in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[d["model_type"]]
    raise _unsupported(f"(no 'architectures'; model_type={d.get('model_type')!r})")


def _reject_unsupported_hf_options(d: dict) -> None:
    """HF options the one decoder does not implement: an error rather than a silently different model."""
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
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
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
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
    if arch in ("qwen3", "gemma3", "qwen3_moe"):
        extra["qk_norm"] = True
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


def _hf_experts(arch: str, d: dict) -> dict[str, Any]:
    """The expert switches of an MoE config (qwen3_moe, mixtral); transformers 5 writes qwen3_moe's num_experts
    as num_local_experts."""
    if arch not in ("qwen3_moe", "mixtral"):
        return {}
    n = d.get("num_experts") or d.get("num_local_experts")
    if not n or not d.get("num_experts_per_tok"):
        raise ValueError(f"{arch}: config.json needs num_experts (or num_local_experts) and num_experts_per_tok")
    if d.get("shared_expert_intermediate_size"):
        raise ValueError(f"{arch}: shared experts are not supported")
    out = dict(num_experts=int(n), num_experts_per_tok=int(d["num_experts_per_tok"]))
    if arch == "qwen3_moe":
        out.update(moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
    return out


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
    return None, None


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """HF rope_scaling with a "rope_type" key, or None for plain RoPE."""
    if not scaling:
        return None
    s = dict(scaling)
    if "rope_type" not in s and "type" in s:
        s["rope_type"] = s["type"]
    s.pop("type", None)
    if s.get("rope_type") in (None, "default"):
        return None
    return s
