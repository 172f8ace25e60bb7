"""Batch-1 decode attention of one chunk (256 keys or fewer) at 2 threads against 1 (decode_attention.cpp's
split_heads: with fewer tasks than threads a row's KV heads are split over tasks where the work is worth it; at
1 thread the row is one task, as every thread count ran it before). Three head shapes: SmolLM2-135M (9 over 3
KV heads of 64), Qwen3-1.7B (16 over 8 of 128), Qwen3-30B-A3B (32 over 4 of 128); a bf16 cache of 8 layers; the
two thread counts interleaved in one process, best of --reps rounds of --calls calls. The split changes no bit
(tests/kernels/test_decode_attention.py), so the figures decide where it runs.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/decode_attention_heads.py
"""
from __future__ import annotations

import argparse

import torch

from tandem import kernels
from tandem.bench import interleaved_best

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Qwen3-1.7B": (16, 8, 128), "Qwen3-30B-A3B": (32, 4, 128)}


def case(h: int, kvh: int, d: int, keys: int, threads: int, calls: int, g: torch.Generator):
    """The op on one row of `keys` keys in scattered slots, at `threads` threads, `calls` times."""
    cache = torch.randn(2 * keys + 1, 8, 2, kvh, d, generator=g).to(torch.bfloat16)
    kv_index = torch.randperm(2 * keys, generator=g)[:keys][None]
    q, lens = torch.randn(1, h, d, generator=g), torch.tensor([keys])

    def run() -> None:
        torch.set_num_threads(threads)
        for _ in range(calls):
            torch.ops.tandem.decode_attention(q, cache, 3, kv_index, lens, d ** -0.5)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="32,128,256", help="keys of the row, comma-separated")
    ap.add_argument("--calls", type=int, default=50, help="op calls a timed round")
    ap.add_argument("--reps", type=int, default=30, help="interleaved timed rounds; the best counts")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("native kernels unavailable")
    g = torch.Generator().manual_seed(0)
    print("| heads (query / KV x head_dim) | keys | 1 thread, us | 2 threads, us | 2 / 1 |")
    print("|---|---|---|---|---|")
    for name, (h, kvh, d) in SHAPES.items():
        for keys in (int(k) for k in args.keys.split(",")):
            one, two = interleaved_best([case(h, kvh, d, keys, t, args.calls, g) for t in (1, 2)], args.reps)
            print(f"| {name} ({h} / {kvh} x {d}) | {keys} | {1e6 * one / args.calls:.1f} | "
                  f"{1e6 * two / args.calls:.1f} | {two / one:.2f} |", flush=True)


if __name__ == "__main__":
    main()
