"""The q8_0 KV cache's format in torch (kv_cache_dtype="q8_0"; csrc/kv_q8.h is the native side, bit for bit).

A head's K or V row of D elements is D / 32 blocks of 34 bytes, llama.cpp's block_q8_0: an fp16 scale d, then 32
int8 quants q; the element is d * q. The cache is a uint8 tensor [S + 1, L, 2, KVH, D / 32 * 34]: a q8_0 cache is
told apart by its dtype (uint8), and every slot-indexed copy moves its rows as bytes.

Why q8_0: a decode step at a long context reads every key and value of its rows; 34 bytes for 32 elements are
0.53x of bf16's 64 (llama.cpp's -ctk q8_0 -ctv q8_0), so twice the tokens fit and each is read in half the bytes.
"""
from __future__ import annotations

import torch

BLOCK, BLOCK_BYTES = 32, 34
Q8_0 = torch.uint8           # the element type a q8_0 cache tensor has


def row_bytes(head_dim: int) -> int:
    """Bytes of a head's q8_0 row (head_dim a multiple of 32)."""
    if head_dim % BLOCK:
        raise ValueError(f"kv_cache_dtype='q8_0' needs head_dim a multiple of {BLOCK}, got {head_dim}")
    return head_dim // BLOCK * BLOCK_BYTES


def is_q8(cache: torch.Tensor) -> bool:
    return cache.dtype == Q8_0


def head_dim(cache: torch.Tensor) -> int:
    """D of a cache [..., E]: E itself, or q8_0's E / 34 * 32."""
    e = cache.shape[-1]
    return e // BLOCK_BYTES * BLOCK if is_q8(cache) else e


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> uint8 [..., D / 32 * 34]: d = max|x| / 127 in fp32, q = round-half-even(x * (1 / d)) (0 where
    d is 0), d stored rounded to fp16. The native writers (csrc/kv_q8.h) give these bytes exactly."""
    d_in = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], row_bytes(d_in) // BLOCK_BYTES, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, torch.reciprocal(d), torch.zeros_like(d))
    q = (blocks * inv).round().to(torch.int8)
    scale = d.to(torch.float16)
    out = torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=-1)     # [..., D / 32, 34]
    return out.reshape(*x.shape[:-1], -1)


def dequantize(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., D / 32 * 34] -> [..., D] in dtype: d * q in fp32 (exact), then rounded to dtype."""
    blocks = b.reshape(*b.shape[:-1], -1, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()                # [..., D / 32, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()                   # [..., D / 32, 32]
    return (q * d).reshape(*b.shape[:-1], -1).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New K or V rows [..., D] as the cache holds them: rounded to its dtype, or q8_0 blocks."""
    return quantize(x) if is_q8(cache) else x.to(cache.dtype)


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, [..., E], in dtype [..., D] (exact for bf16 / fp16 / q8_0 into fp32)."""
    return dequantize(rows, dtype) if is_q8(rows) else rows.to(dtype)
