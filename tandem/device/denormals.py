"""Denormal floats flushed to zero (FTZ / DAZ) in a device process, set before its first parallel region so every
worker thread inherits it (a new thread copies its creator's floating-point environment).

Why: an int8-activation block whose values are all tiny (products of two small values, a random-weight model's
gelu(gate) * up) has a denormal scale, and every product with it runs ~40x slower: a Gemma-4-26B-A4B-shaped file's
dense down projection took 550 ms for a 512-token chunk instead of 13 ms (benchmarks/results/gemma4_26b_a4b.md).
llama.cpp keeps its activation scales in fp16, which flushes them anyway. Only values below 1.2e-38 change (to 0),
the same on every path and thread of the process; the inline backend leaves the caller's process as it is."""
from __future__ import annotations


def flush_denormals() -> None:
    import torch
    torch.set_flush_denormal(True)
