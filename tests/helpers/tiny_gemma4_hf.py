"""make_tiny_gemma4: tiny random Gemma 4 text models (transformers' Gemma4ForCausalLM) with SmolLM2's tokenizer, saved
as transformers saves them, every norm, scale and layer scalar randomized so that each changes the output. Variants:
"dense" (full layers with their own head shape), "kv" (attention_k_eq_v: full layers' V is K's projection, one
global KV head), "moe" (kv plus experts beside the MLP), "ple" (per-layer inputs, KV-shared last layers with a
double-wide MLP)."""
from __future__ import annotations

import os

import torch

from tests.helpers.tiny_models import smollm2_tokenizer

GEMMA4 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=512,
              final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
VARIANTS = {
    "dense": {},
    "kv": dict(num_global_key_value_heads=1, attention_k_eq_v=True),
    "moe": dict(num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32),
    "ple": dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                layer_types=["sliding_attention", "full_attention"] * 3),
}


def make_tiny_gemma4(tmp_dir, variant: str = "dense", *, seed: int = 0, cache_dir: str | None = None,
                     **overrides) -> str:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    tok = smollm2_tokenizer(cache_dir)
    config = Gemma4TextConfig(**{**GEMMA4, **VARIANTS[variant], "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                                 "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **overrides})
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Gemma4ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.3 * torch.randn(b.shape, generator=gen))
    os.makedirs(tmp_dir, exist_ok=True)
    model.save_pretrained(str(tmp_dir))
    tok.save_pretrained(str(tmp_dir))
    return str(tmp_dir)
