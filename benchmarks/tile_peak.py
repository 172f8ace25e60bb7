"""The prefill and batch tile against the CPU's int8 peak (issue 67's yardstick), in one run.

A K-quant's prompt rows and batch rows run the packed GEMV (gemv_packed_q8act: the packed copy is the weight's only
one). For each linear of a layer of the 1.5B shape (Q4_K_M's types: q/k/v, o and gate_up Q4_K, down Q6_K; random
blocks), at M rows of x on T threads: GOP/s (2 M N K over the best of --reps) and its share of the int8 peak,
2 x torch.ops.tandem.int8_peak (the multiply-adds per second of the body's own dot-product instruction: vpdpbusd
on AVX-512 VNNI, vpmaddubsw + vpmaddwd on AVX2) measured on the same threads right before. "layer" is the layer's
linears together (their operations over their summed time). The CPU's steal over each row is printed beside it.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/tile_peak.py [--threads 2] [--rows 16,64,512] \
        [--isa -1] [--json benchmarks/results/tile_peak.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.kernels.test_gemm_rows_q8act import _weight  # noqa: E402

from tandem import kernels  # noqa: E402
from tandem.kernels.quant import Q4_K, Q6_K  # noqa: E402

LAYER = [("qkv", 2048, 1536, Q4_K), ("o", 1536, 1536, Q4_K), ("gate_up", 17920, 1536, Q4_K),
         ("down", 1536, 8960, Q6_K)]          # qwen2.5-1.5b: hidden 1536, 12 + 2 x 2 heads of 128, MLP 8960


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def best_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="threads of the op and of the peak probe")
    ap.add_argument("--rows", default="16,64,512", help="rows of x, comma-separated")
    ap.add_argument("--isa", type=int, default=-1, help="the body: -1 the best here, 1 AVX2, 2 AVX-512 VNNI")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per figure (the best is kept)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    assert kernels.available(), kernels.unavailable_reason()
    torch.set_num_threads(args.threads)
    T = torch.ops.tandem
    weights = {name: (n, k, qt, T.pack_gemv((q := _weight(n, k, qt, seed=1)).data, qt, k)) for name, n, k, qt in LAYER}
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        s0 = steal()
        peak = 2 * max(T.int8_peak(4_000_000, args.isa) for _ in range(7)) / 1e9     # ~20 ms a call
        ops = secs = 0.0
        for name, (n, k, qt, packed) in weights.items():
            x = torch.randn(m, k)
            s = best_s(lambda: T.gemv_packed_q8act(x, packed, qt, k, n, None, args.isa), args.reps)
            gop = 2 * m * n * k / 1e9
            ops, secs = ops + gop, secs + s
            rows.append({"rows": m, "linear": name, "n": n, "k": k, "ms": s * 1e3, "gop_s": gop / s,
                         "share_of_peak": gop / s / peak, "peak_gop_s": peak})
            print(f"M {m:4d} {name:8s} {n:5d} x {k:4d}: {s * 1e3:8.3f} ms {gop / s:6.0f} GOP/s "
                  f"{100 * gop / s / peak:5.1f} % of {peak:.0f}", flush=True)
        rows.append({"rows": m, "linear": "layer", "gop_s": ops / secs, "share_of_peak": ops / secs / peak,
                     "peak_gop_s": peak, "steal_ticks": steal() - s0})
        print(f"M {m:4d} layer   : {ops / secs:6.0f} GOP/s, {100 * ops / secs / peak:5.1f} % of the int8 peak "
              f"{peak:.0f} GOP/s (steal {steal() - s0} ticks)", flush=True)
    flags = [f for f in open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
             if f.startswith(("avx", "amx", "fma"))]
    result = {"threads": args.threads, "isa": args.isa, "cpu_flags": flags, "rows": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
