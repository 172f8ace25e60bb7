"""The int8 GEMV on repacked weights (tandem.gemv_packed_q8act) against the row layout's ops it replaces, on SmolLM2's
linear shapes: linear_rows_q8act (gemv_rows_q8act up to 16 rows with VNNI, the AVX2 decode body on AVX2) and
gemm_rows_q8act (the GEMM, AMX where the CPU has it), all on the same random weights and x, interleaved, best of --reps.
The three give the same bits (tests/kernels/test_gemv_packed_q8act.py), so the figures choose
gemv_packed_q8act_max_rows() only.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/packed_gemv.py [--threads 1] [--rows 1,2,...]
    TANDEM_ISA=avx2 ... (the AVX2 bodies)        writes benchmarks/results/packed_gemv[_TAG].json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.kernels.test_gemm_rows_q8act import _weight  # noqa: E402

from tandem import kernels  # noqa: E402
from tandem.kernels.quant import Q4_1, Q8_0  # noqa: E402

SHAPES = [(960, 576, Q4_1), (576, 576, Q4_1), (3072, 576, Q4_1), (576, 1536, Q4_1), (8192, 576, Q8_0)]
# qkv, o, gate_up, down (Q4_1) and a 8192-row slice of the tied Q8_0 LM head (49,152 x 576)


def best_ms(f, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(10):
            f()
        best = min(best, (time.perf_counter() - t) / 10)
    return 1e3 * best


def cpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    keep = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    return f"{model}; " + " ".join(f for f in keep if f in flags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads for every op (1: robust on a shared machine)")
    p.add_argument("--rows", default="1,2,4,5,8,16,24,32,64,96,128,256", help="rows of x, comma-separated")
    p.add_argument("--reps", type=int, default=7, help="timed repeats of 10 calls each; the best counts")
    p.add_argument("--tag", default="", help="suffix of the result file (e.g. avx2)")
    args = p.parse_args()
    if not kernels.available():
        sys.exit("native kernels unavailable")
    torch.set_num_threads(args.threads)
    T = torch.ops.tandem
    rows = [int(r) for r in args.rows.split(",")]
    out = {"cpu": cpu_flags(), "isa": kernels.isa(), "threads": args.threads, "shapes": []}
    for n, k, qt in SHAPES:
        q = _weight(n, k, qt, seed=1)
        packed = T.pack_gemv(q.data, qt, k)
        res = []
        for m in rows:
            x = torch.randn(m, k)
            ops = {"linear_rows_q8act": lambda: T.linear_rows_q8act(x, q.data, qt, k, None),
                   "gemm_rows_q8act": lambda: T.gemm_rows_q8act(x, q.data, qt, k, None),
                   "gemv_packed_q8act": lambda: T.gemv_packed_q8act(x, packed, qt, k, n, None)}
            res.append({"m": m, **{name: round(best_ms(f, args.reps), 4) for name, f in ops.items()}})
        out["shapes"].append({"n": n, "k": k, "qtype": qt, "rows": res})
        print(n, k, qt, " | ".join(f"{r['m']}: {r['linear_rows_q8act']:.3f} {r['gemm_rows_q8act']:.3f} "
                                   f"{r['gemv_packed_q8act']:.3f}"
                                   for r in res), flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "results", f"packed_gemv{'_' + args.tag if args.tag else ''}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.relpath(path, os.path.join(here, "..")))


if __name__ == "__main__":
    main()
