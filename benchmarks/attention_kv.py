"""The native decode attention alone (csrc/decode_attention.cpp) per KV cache dtype and with shared-prefix
(cascade) attention on and off: 30 layers of SmolLM2-135M's heads (9 query heads, 3 KV heads of 64) on three
step shapes of issue 22's workloads, best of --reps, one thread by default, process time (less sensitive to
other processes on the machine than wall time).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/attention_kv.py [--threads 1] [--out FILE.json]

Shapes: 64 rows of 96-159 keys (the 64 x 32 -> 128 decode), 32 rows on one cached 900-key prefix plus 24-56
keys of their own (the shared-prefix workload), and one row of 2,048 keys (batch 1 at 2k context).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import cpu_flags  # noqa: E402

from tandem import kernels  # noqa: E402

LAYERS, H, KVH, D = 30, 9, 3, 64
SHAPES = {  # name: per row (group, shared keys, own keys)
    "decode 64 rows x 96-159 keys": [(i, 0, 96 + i % 64) for i in range(64)],
    "32 rows on a 900-key prefix": [(0, 900, 24 + i) for i in range(32)],
    "batch 1 x 2048 keys": [(0, 0, 2048)],
}


def batch(specs, dtype: torch.dtype, seed: int = 0):
    """A cache of LAYERS layers whose rows of one group share their first slots (a cached prefix)."""
    g = torch.Generator().manual_seed(seed)
    longest = max(s for _, s, _ in specs)
    prefix = {grp: torch.randperm(10_000, generator=g)[:longest] for grp, _, _ in specs}
    rows, nxt = [], 10_000
    for grp, shared, own in specs:
        rows.append(torch.cat([prefix[grp][:shared], torch.arange(nxt, nxt + own)]))
        nxt += own
    lens = torch.tensor([len(r) for r in rows])
    kv_index = torch.full((len(rows), int(lens.max())), nxt, dtype=torch.long)
    for i, r in enumerate(rows):
        kv_index[i, :len(r)] = r
    cache = torch.randn(nxt + 1, LAYERS, 2, KVH, D, generator=g).to(dtype)
    cache[nxt] = 0
    return cache, kv_index, lens, torch.randn(len(rows), H, D, generator=g)


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the op")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (best taken)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if not kernels.available():
        sys.exit(f"native kernels not built: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    rows = []
    for name, specs in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            cache, kv_index, lens, q = batch(specs, dtype)
            for share in (False, True):
                torch.ops.tandem.shared_prefix_attention(int(share))
                ms = best_ms(lambda: [torch.ops.tandem.decode_attention(q, cache, layer, kv_index, lens, 0.125)
                                      for layer in range(LAYERS)], args.reps)
                rows.append({"shape": name, "kv": str(dtype).removeprefix("torch."), "shared_prefix": share,
                             "ms_30_layers": round(ms, 2)})
                print(f"{name:32s} {rows[-1]['kv']:9s} shared {'on ' if share else 'off'} {ms:7.2f} ms")
    torch.ops.tandem.shared_prefix_attention(1)
    out = {"threads": args.threads, "cpu": cpu_flags(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
