"""Embeddings: the pooled hidden state a step returns for each of its embeddings rows (StepInput.embed).

Pooling is `last`: a row's last token's final-normed hidden state, the row the LM head reads to sample, taken on
the request's last prefill chunk (so chunked prefill and prefix-cache hits change nothing: the last token is
always computed). The device returns it raw (float32); the host L2-normalizes it one vector at a time, so a
vector's bits never depend on its batch mates.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def pooled(step, hidden: torch.Tensor) -> torch.Tensor | None:
    """hidden [B, H] (each row's last token, final-normed) -> [E, H] float32 at the rows that asked, in batch
    order; None where none did."""
    rows = np.nonzero(step.embed)[0]
    if not len(rows):
        return None
    return hidden[torch.from_numpy(rows).to(hidden.device)].float()


def normalized(vector: np.ndarray) -> bytes:
    """One vector [H], L2-normalized, as little-endian float32 bytes (OpenAI's base64 payload); an all-zero
    vector stays zero. The norm is an exactly rounded sum (math.fsum): no BLAS order or alignment in it."""
    v = vector.astype(np.float64)
    norm = math.sqrt(math.fsum(v * v))
    return (v / norm if norm > 0 else v).astype("<f4").tobytes()


def vector(data: bytes) -> list[float]:
    """The floats of normalized()'s bytes."""
    return np.frombuffer(data, "<f4").tolist()
