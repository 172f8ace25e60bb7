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
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(SUPPORTED_HF_ARCHITECTURES.values())

# Defaults of the HF config classes for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
}


def _unsupported(what: str) -> ValueError:
    names = ", ".join(SUPPORTED_HF_ARCHITECTURES)
    return ValueError(f"unsupported model architecture {what}; supported architectures: {names}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
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

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4 or 5 layout)."""
        archs = d.get("architectures") or []
        arch = None
        for a in archs:
            if a in SUPPORTED_HF_ARCHITECTURES:
                arch = SUPPORTED_HF_ARCHITECTURES[a]
                break
        if arch is None:
            if archs:
                raise _unsupported(", ".join(map(repr, archs)))
            if d.get("model_type") in SUPPORTED_ARCHITECTURES:
                arch = d["model_type"]
            else:
                raise _unsupported(f"(no 'architectures'; model_type={d.get('model_type')!r})")

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"config.json is missing required key {key!r}")
            return d[key]

        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if arch == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=True) is not supported")

        defaults = _HF_DEFAULTS[arch]
        hidden = int(req("hidden_size"))
        num_heads = int(req("num_attention_heads"))
        num_kv = int(d.get("num_key_value_heads") or num_heads)
        head_dim = int(d.get("head_dim") or hidden // num_heads)

        # transformers 5 folds rope_theta and rope_scaling into "rope_parameters".
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", defaults["rope_theta"]))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params:
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        scaling = _normalize_rope_scaling(scaling)

        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(i) for i in eos)
        else:
            eos_ids = (int(eos),)
        bos = d.get("bos_token_id")

        return cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
            max_position_embeddings=int(d.get("max_position_embeddings")
                                        or defaults["max_position_embeddings"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    # ------------------------------------------------------------ plain data
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["eos_token_ids"] = tuple(int(i) for i in kw.get("eos_token_ids") or ())
        if kw.get("rope_scaling") is not None:
            kw["rope_scaling"] = copy.deepcopy(dict(kw["rope_scaling"]))
        return cls(**kw)


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
