"""The one-row decode GEMV streaming weights from DRAM: tandem.gemv_packed_q8act on the packed copy against the row
layout's linear_rows_q8act, per K-quant, over several 8192 x 8192 matrices summing to past --mb MB (well past L3, so
every pass reads DRAM), each op timed over whole passes and given as GB/s of the weight bytes it reads (the two
layouts are the same size). Random super-blocks with small finite fp16 scales.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/packed_gemv_stream.py [--threads 2] [--types Q2_K,Q3_K]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.packed_gemv import cpu_flags  # noqa: E402

from tandem import kernels  # noqa: E402
from tandem.kernels import quant  # noqa: E402

SCALES_AT = {"Q2_K": (80, 4), "Q3_K": (108, 2), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 2)}   # d (dmin)


def random_weight(name: str, n: int, k: int, seed: int) -> quant.QuantWeight:
    qt = getattr(quant, name)
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // 256, quant.BLOCK_BYTES[qt]), dtype=torch.uint8, generator=g)
    at, nd = SCALES_AT[name]
    d = (torch.randn(n, k // 256, nd // 2, generator=g) * 0.01).half().view(torch.uint8)
    b[..., at:at + nd] = d.reshape(n, k // 256, nd)
    return quant.QuantWeight.from_gguf(b.reshape(n, -1), qt, k)


def gbps(fn, ws: list, passes: int) -> float:
    """GB/s of the weights' bytes over the best of `passes` passes (one call a matrix), after a warm pass."""
    for w in ws:
        fn(w)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for w in ws:
            fn(w)
        best = min(best, time.perf_counter() - t)
    return sum(w[0].data.numel() for w in ws) / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--types", default="Q2_K,Q3_K,Q4_K")
    p.add_argument("--mb", type=int, default=600, help="weight bytes a type streams per pass, in MB (L3: less)")
    p.add_argument("--passes", type=int, default=5)
    args = p.parse_args()
    if not kernels.available():
        sys.exit("native kernels unavailable")
    torch.set_num_threads(args.threads)
    T = torch.ops.tandem
    n = k = 8192
    x = torch.randn(1, k)
    print(f"{cpu_flags()}; isa {kernels.isa()}; {args.threads} threads; {n} x {k} matrices, 1 row of x")
    for name in args.types.split(","):
        qt = getattr(quant, name)
        per = n * k // 256 * quant.BLOCK_BYTES[qt]
        count = -(-args.mb * 10**6 // per)
        ws = [(w := random_weight(name, n, k, i), T.pack_gemv(w.data, qt, k)) for i in range(count)]
        mb = sum(w.data.numel() for w, _ in ws) / 1e6
        packed = gbps(lambda w: T.gemv_packed_q8act(x, w[1], qt, k, n, None), ws, args.passes)
        rows = gbps(lambda w: T.linear_rows_q8act(x, w[0].data, qt, k, None), ws, args.passes)
        print(f"{name}: {len(ws)} matrices, {mb:.0f} MB: packed {packed:.1f} GB/s, row layout {rows:.1f} GB/s "
              f"({packed / rows:.2f}x)", flush=True)
        del ws


if __name__ == "__main__":
    main()
