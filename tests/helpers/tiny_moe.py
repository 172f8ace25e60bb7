"""The expert tensors of a tiny MoE model (tiny_models.make_tiny_model's qwen3_moe / mixtral) as llama.cpp's
convert_hf_to_gguf writes them: the router as ffn_gate_inp (F32), every expert's gate / up / down stacked into one
3-D tensor [E, rows, K] (ffn_gate_exps, ffn_up_exps, ffn_down_exps), or the older layout, one tensor per expert
(ffn_gate.E), and the expert metadata ({arch}.expert_count, expert_used_count, expert_feed_forward_length)."""
from __future__ import annotations

import re

import numpy as np

# The HF names (Qwen3-MoE's and Mixtral's) of a layer's expert tensors -> llama.cpp's.
EXPERT_NAMES = {"mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
                "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
                "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
                "mlp.experts.down_proj.weight": "ffn_down_exps.weight"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def stack_experts(sd: dict, split: bool = False) -> dict:
    """sd with each layer's per-expert matrices as one [E, rows, K] entry "model.layers.N.mlp.experts.P_proj.weight"
    (split: kept one per expert, as "model.layers.N.ffn_P.E" for the older layout), in the file's order."""
    out, stacks = {}, {}
    for name, t in sd.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        layer, e, proj = int(m.group(1)), int(m.group(2)), _PROJ[m.group(3)]
        if split:
            out[f"blk.{layer}.ffn_{proj}.{e}.weight"] = t
        else:
            key = f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"
            stacks.setdefault(key, {})[e] = np.asarray(t, dtype=np.float32)
            out.setdefault(key, None)
    for key, per in stacks.items():
        out[key] = np.stack([per[e] for e in range(len(per))])
    return out


def add_expert_metadata(w, cfg: dict) -> None:
    """The expert keys of a qwen3_moe / mixtral config.json (nothing for a dense model)."""
    n = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n:
        return
    w.add_expert_count(int(n))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
