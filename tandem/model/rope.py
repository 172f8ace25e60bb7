"""Rotary position embeddings in torch: the frequencies of a model's global and sliding layers (with their
scalings), and their application to [T, heads, D] rows (the torch path; the native op is tandem.rope_)."""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """RoPE frequencies of the model's global layers, or (local) of its sliding layers: their own base
    (rope_local_theta, gemma3) and no scaling."""
    dim = config.rotary_dim                     # a partial rotary share turns only the first dims
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    if not local and (config.global_head_dim or config.rope_proportion < 1.0):
        return proportional_inv_freq(theta, config.global_head_dim or config.head_dim, config.rope_proportion)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local and config.rope_local_theta else config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(scaling, theta, dim)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")


def proportional_inv_freq(theta: float, dim: int, proportion: float) -> torch.Tensor:
    """gemma4's full layers ("proportional" RoPE): the first proportion of a head's dim / 2 frequency pairs turn at
    theta^(-2i / dim), the exponent over the whole head dim, and the rest get frequency 0 (cos 1, sin 0: they pass
    unchanged, bit for bit, through the same rotate-half form)."""
    turned = int(proportion * dim // 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * turned, 2, dtype=torch.int64).float() / dim))
    return torch.cat([inv_freq, torch.zeros(dim // 2 - turned)])


def _yarn_inv_freq(scaling: dict, theta: float, dim: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), transformers' form: each frequency between its interpolated (/ factor) and its
    original value by a linear ramp over the dims whose wavelengths fall between beta_fast and beta_slow rotations
    of the original context (the ramp's ends rounded out unless truncate is false, as gpt-oss sets it)."""
    factor, ctx = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolate = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate


def rope_attention_factor(config: ModelConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or 0.1 ln(factor) + 1, or the ratio of
    two such with mscale / mscale_all_dim); 1 for every other scaling."""
    scaling = None if local and config.rope_local_theta else config.rope_scaling
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale()


def rope_tables(c: ModelConfig, max_context: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """(cos, sin, cos_local, sin_local): [max_context, D] tables of the global layers and of the sliding ones (the
    same tensors unless those have their own base), times YaRN's attention factor where the scaling has one."""
    def table(inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(max_context, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                         # [max_context, D]
        cos, sin = (emb.cos(), emb.sin()) if factor == 1.0 else (emb.cos() * factor, emb.sin() * factor)
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    cos, sin = table(rope_inv_freq(c), rope_attention_factor(c))
    if c.rope_local_theta and c.sliding_window:
        return (cos, sin, *table(rope_inv_freq(c, local=True), rope_attention_factor(c, local=True)))
    return cos, sin, cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos / sin [T, 1, R]: the first R dims of each head turned (R < D: a partial rotary share),
    the others passed."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
