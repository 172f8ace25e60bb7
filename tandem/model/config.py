"""Model hyper-parameters, independent of where the weights came from (hf_config.py reads config.json into them;
gguf/config.py reads GGUF metadata)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from .hf_config import (HYBRID_ARCHITECTURES, LAYER_TYPES, SUPPORTED_ARCHITECTURES, SUPPORTED_HF_ARCHITECTURES,
                        hf_config_kwargs, unsupported)

@dataclass(frozen=True)
class ModelConfig:
    """One decoder; architectures differ only by the switches below (read from config.json or GGUF metadata).

    llama / mistral: the defaults (mistral may set sliding_window). qwen2: attention_bias. qwen3: qk_norm.
    gpt_oss: attention sinks, q / k / v / o biases, alternating sliding (128) and full layers, YaRN, experts in
    every layer with biases, a biased router softmaxed over its top-k and the clamped SwiGLU ("swiglu_oai").
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
    shared_expert_intermediate_size: int = 0     # an MoE layer's always-run expert, gated by sigmoid(x . w); 0: none
    # Hybrids (qwen3_5, qwen3_5_moe, qwen3_next): layer_types' "linear_attention" layers run a Gated DeltaNet
    # (model/linear_attention.py) over a per-request state instead of attending over KV pages
    linear_num_key_heads: int = 0    # its q / k heads (each serves linear_num_value_heads / this value heads)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0      # the causal depthwise conv's width over q / k / v (its state: width - 1 tokens)
    partial_rotary_factor: float = 1.0   # RoPE turns the first head_dim * factor dims of a head; the rest pass
    attn_output_gate: bool = False   # q_proj also gives each head a gate: attention output * sigmoid(gate)
    linear_value_heads_tiled: bool = False   # value head h reads key head h mod key heads (llama.cpp's Qwen3.5 files); else h div (value / key heads), HF's
    # gpt-oss
    attention_sinks: bool = False    # each head's softmax also counts a learned sink logit (self_attn.sinks), no value
    attention_out_bias: bool = False     # o_proj has a bias (gpt-oss; attention_bias covers q / k / v)
    moe_bias: bool = False           # the router and every expert's linears have biases
    moe_routing: str = "softmax_topk"    # "softmax_topk": softmax over all experts, then top-k; "topk_softmax": top-k logits, then their softmax (gpt-oss)
    swiglu_alpha: float = 1.702      # hidden_act "swiglu_oai": (clamp(up) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=limit)
    swiglu_limit: float = 7.0
    # gemma4 (model/gemma4.py): full layers with their own head shape, V as K's projection, per-layer inputs
    global_head_dim: int = 0         # full_attention layers' head dim; 0: head_dim
    global_kv_heads: int = 0         # full_attention layers' KV heads; 0: num_kv_heads
    attention_k_eq_v: bool = False   # full layers have no v_proj: V is k_proj's output (normed by v_norm, not turned)
    v_norm: bool = False             # V RMS-normed over its head dim, no weight
    # full layers' "proportional" RoPE: the first share of frequency pairs turn (exponent over the whole head dim)
    rope_proportion: float = 1.0
    final_logit_softcapping: float | None = None     # logits = c * tanh(logits / c)
    layer_scalar: bool = False       # a layer's output, residual stream included, times its layer_scalar [1]
    moe_beside_mlp: bool = False     # the experts run beside the dense MLP (gemma4), routed on the layer's input
    per_layer_input_size: int = 0    # per-layer input embeddings (gemma4 E2B / E4B): each layer's width; 0: none
    per_layer_vocab_size: int = 0    # rows of their table (embed_tokens_per_layer)
    num_kv_shared_layers: int = 0    # the last layers read the KV of the last earlier layer of their type
    double_wide_mlp: bool = False    # those KV-shared layers' dense MLP is twice intermediate_size wide

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported(repr(self.architecture))
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
        if self.hidden_act not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu, gelu_tanh, swiglu_oai)")
        if self.moe_routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"moe_routing {self.moe_routing!r} is not supported (softmax_topk, topk_softmax)")
        self._check_experts()
        self._check_linear_attention()
        self._check_layer_shapes()

    def _check_layer_shapes(self) -> None:
        for f in ("global_head_dim", "global_kv_heads", "per_layer_input_size", "num_kv_shared_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"ModelConfig.{f} must be an int >= 0, got {v!r}")
        if self.global_kv_heads and self.num_heads % self.global_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of global_kv_heads "
                             f"({self.global_kv_heads})")
        if not 0.0 < self.rope_proportion <= 1.0:
            raise ValueError(f"rope_proportion must be in (0, 1], got {self.rope_proportion!r}")
        if self.num_kv_shared_layers:
            first = self.num_layers - self.num_kv_shared_layers
            if first <= 0 or any(self.kv_source(i) >= first for i in range(first, self.num_layers)):
                raise ValueError(f"num_kv_shared_layers {self.num_kv_shared_layers}: every shared layer needs an "
                                 f"earlier layer of its type among the first {max(first, 0)}")

    def mlp_width(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width: intermediate_size, doubled in a KV-shared layer under double_wide_mlp."""
        shared = layer >= self.num_layers - self.num_kv_shared_layers and self.num_kv_shared_layers
        return self.intermediate_size * (2 if self.double_wide_mlp and shared else 1)

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s attention head dim: a full layer's global_head_dim where the config sets one."""
        return self.global_head_dim if self.global_head_dim and not self.is_sliding(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Layer `layer`'s KV heads: a full layer's global_kv_heads where the config sets one."""
        return self.global_kv_heads if self.global_kv_heads and not self.is_sliding(layer) else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends: itself, or for one of the last num_kv_shared_layers the
        last layer before them of the same type (it has no k / v projections and writes no KV)."""
        first = self.num_layers - self.num_kv_shared_layers
        if layer < first:
            return layer
        kind = self.is_sliding(layer)
        return next((j for j in range(first - 1, -1, -1) if self.is_sliding(j) == kind), layer)

    def _check_linear_attention(self) -> None:
        if not self.linear_layers:
            return
        dims = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                self.linear_value_head_dim, self.linear_conv_kernel)
        if min(dims) <= 0 or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_attention layers need positive head counts, head dims and conv width, value "
                             f"heads a multiple of key heads; got {dims}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim}"
                             f" (head_dim {self.head_dim}): it must be even and in 2..head_dim")

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
        return (self.num_experts > 0 and not self.moe_beside_mlp and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear attention, a per-request state) rather than attention."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's conv (and its in_proj_qkv rows): q and k of every key head, v of
        every value head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * \
            self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        """The dims of a head RoPE turns (the first ones): head_dim unless partial_rotary_factor says less."""
        return int(self.head_dim * self.partial_rotary_factor)

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
        """Build from a Hugging Face config.json dict (transformers 4 or 5 layout; hf_config.py)."""
        return cls(**hf_config_kwargs(d))

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


__all__ = ["HYBRID_ARCHITECTURES", "LAYER_TYPES", "SUPPORTED_ARCHITECTURES", "SUPPORTED_HF_ARCHITECTURES", "ModelConfig"]
