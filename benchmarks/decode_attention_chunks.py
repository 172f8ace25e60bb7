"""The decode attention op's chunk size (decode_attention.cpp's row_chunk: MIN_CHUNK) on SmolLM2-135M's heads
(9 over 3 KV heads, head_dim 64, bf16 cache, 30 layers' slots): the op with chunk_keys = -1 (the built
policy) next to forced chunk sizes, on the batches a server meets, interleaved in one process, best of
--reps. A chunk size changes the summation order only (every size is exact to the reference within fp32
rounding, tests/kernels/test_decode_attention.py), so the figures choose it.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/decode_attention_chunks.py [--threads 2]
"""
from __future__ import annotations

import argparse

import torch

from tandem import kernels
from tandem.bench import interleaved_best

H, KVH, D, LAYERS = 9, 3, 64, 30


def batch(own: list[int], prefix: int, g: torch.Generator):
    """Rows of `own` keys each after a `prefix` of slots they all share (the radix cache's shared prefix):
    (q, cache, kv_index, seq_lens) on SmolLM2's heads, a bf16 cache of LAYERS layers."""
    b, longest = len(own), max(own)
    cache = torch.randn(prefix + b * longest + 2, LAYERS, 2, KVH, D, generator=g).to(torch.bfloat16)
    lens = torch.tensor([prefix + n for n in own])
    kv_index = torch.zeros(b, prefix + longest, dtype=torch.long)
    kv_index[:, :prefix] = torch.arange(1, prefix + 1)
    for r in range(b):
        kv_index[r, prefix:] = prefix + 1 + r * longest + torch.arange(longest)
    return torch.randn(b, H, D, generator=g), cache, kv_index, lens


def case(own: list[int], prefix: int, isa: int, chunk_keys: int, g: torch.Generator):
    """The op on batch(own, prefix) with this ISA and chunk size (layer 3)."""
    q, cache, kv_index, lens = batch(own, prefix, g)
    return lambda: torch.ops.tandem.decode_attention(q, cache, 3, kv_index, lens, 0.125, isa, chunk_keys, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the op")
    ap.add_argument("--chunks", default="-1,64,128,256", help="chunk_keys values (-1: the built policy)")
    ap.add_argument("--reps", type=int, default=40, help="interleaved timed rounds; the best counts")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("native kernels unavailable")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    batches = {"64 rows of 100-220 keys": ([int(x) for x in torch.randint(100, 220, (64,), generator=g)], 0),
               "32 rows, 930-key shared prefix + 24": ([24] * 32, 930),
               "16 rows of 300-900": ([int(x) for x in torch.randint(300, 900, (16,), generator=g)], 0),
               "8 rows of 3000": ([3000] * 8, 0), "1 row of 2000": ([2000], 0), "1 row of 500": ([500], 0)}
    chunks = [int(c) for c in args.chunks.split(",")]
    isas = [i for i in (1, 2) if i <= torch.ops.tandem.isa(2)]
    print(f"| ISA | batch | " + " | ".join(f"chunk {c if c >= 0 else 'policy'}, ms" for c in chunks) + " |")
    print("|---|---|" + "---|" * len(chunks))
    for isa in isas:
        for name, (own, prefix) in batches.items():
            best = interleaved_best([case(own, prefix, isa, c, g) for c in chunks], args.reps)
            print(f"| {kernels.ISA_NAMES[isa]} | {name} | " + " | ".join(f"{1e3 * b:.3f}" for b in best) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
