"""gpt-oss's Hugging Face checkpoints in MXFP4 (openai/gpt-oss-20b, -120b as shipped): each expert tensor as
`*_blocks` (uint8 [E, out, in / 32, 16]: two E2M1 values a byte, the even element in the low nibble) and `*_scales`
(uint8 [E, out, in / 32]: the block's E8M0 exponent), gate_up's rows interleaving gate and up. They become the
contract's per-expert matrices as MXFP4 blocks (kernels/quant.py: ggml's type, held once, run by the native
int8 kernels; the torch path dequantizes them), never a dense copy: gpt-oss-20b's experts are 12 GB in bf16.

ggml's block (the converter's repacking): the exponent byte, then 16 bytes with element i in the low nibble of byte
i and element i + 16 in its high nibble; the same exponent and the same value per nibble index (ggml's values are
E2M1's doubled, its scale 2^(e - 127) halved).
"""
from __future__ import annotations

import torch

from ..kernels.quant import MXFP4, QuantWeight

SUFFIXES = ("_blocks", "_scales")


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G, 16] HF blocks and [..., G] exponents -> [..., G * 17] ggml MXFP4 rows."""
    lo, hi = blocks & 15, blocks >> 4
    nib = torch.stack([lo, hi], dim=-1).flatten(-2)                    # [..., G, 32]: element order
    qs = nib[..., :16] | (nib[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2).contiguous()


def expert_weights(prefix: str, kind: str, blocks: torch.Tensor, scales: torch.Tensor) -> list:
    """[(contract name, QuantWeight)] of one layer's experts from `kind` ("gate_up_proj" or "down_proj") blocks
    and scales; prefix: "model.layers.N.mlp."."""
    e, out, g, _ = blocks.shape
    rows = ggml_blocks(blocks, scales)                                 # [E, out, G * 17]
    k = g * 32
    names = []
    for i in range(e):
        q = f"{prefix}experts.{i}."
        if kind == "down_proj":
            names.append((q + "down_proj.weight", QuantWeight.from_gguf(rows[i], MXFP4, k)))
        else:
            names += [(q + "gate_proj.weight", QuantWeight.from_gguf(rows[i, 0::2].contiguous(), MXFP4, k)),
                      (q + "up_proj.weight", QuantWeight.from_gguf(rows[i, 1::2].contiguous(), MXFP4, k))]
    return names


class PendingMxfp4:
    """The loader's half-seen pairs: a `*_blocks` tensor waits for its `*_scales` (in any order, in any shard)."""

    def __init__(self) -> None:
        self.half: dict[str, torch.Tensor] = {}

    def take(self, name: str, t: torch.Tensor) -> list | None:
        """None where `name` is not an MXFP4 expert tensor; [] while its pair is missing; else the experts."""
        if not name.endswith(SUFFIXES) or ".mlp.experts." not in name:
            return None
        suffix = "_blocks" if name.endswith("_blocks") else "_scales"
        base = name[:-len(suffix)]
        other = self.half.pop(base + ("_scales" if suffix == "_blocks" else "_blocks"), None)
        if other is None:
            self.half[name] = t
            return []
        blocks, scales = (t, other) if suffix == "_blocks" else (other, t)
        prefix, kind = base.split("experts.")[0], base.split("experts.")[1]
        return expert_weights(prefix, kind, blocks, scales)

    def missing(self) -> list[str]:
        return sorted(self.half)
