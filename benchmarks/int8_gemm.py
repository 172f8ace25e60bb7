"""The int8 GEMM (tandem.gemm_rows_q8act) against the decode kernel (linear_rows_q8act) and MKL's fp32 GEMM on
dequantized weights (the path it replaced past small_m() rows), on SmolLM2's linear shapes at 32-512 rows; best of 5.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/int8_gemm.py [--qtype 3] [--isa -1] [--threads 1]

On a CPU with AMX-INT8 the best gemm_rows_q8act body is the AMX one (body 3), and a column beside it times the
AVX-512 VNNI body (isa 2) on the same weights. --isa 1 runs the AVX2 bodies; pair it with MKL_ENABLE_INSTRUCTIONS=AVX2 in the environment to compare with
MKL's AVX2 code (what an AVX2-only machine runs). One thread is the robust reading on a shared 2-core machine
(an OpenMP barrier stalls whenever another process takes a core).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.kernels.test_kernels import blocks  # noqa: E402
from tests.kernels.test_quant_types import weights  # noqa: E402

from tandem import kernels  # noqa: E402
from tandem.kernels.quant import K_QUANTS  # noqa: E402

SHAPES = [(3072, 576), (576, 1536), (960, 576)]      # gate_up, down, qkv (N, K)


CLOCK = time.perf_counter


def best_ms(f, reps: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = CLOCK()
        f()
        best = min(best, CLOCK() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtype", type=int, default=3, help="ggml type id (3 = Q4_1, SmolLM2's; 12 = Q4_K, 14 = Q6_K)")
    ap.add_argument("--isa", type=int, default=-1, help="-1 the best body here, 1 AVX2, 2 AVX-512 (VNNI), 3 AMX")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--rows", default="32,64,128,512", help="row counts M, comma-separated")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by this process's CPU time (steadier than wall time on a VM whose cores are shared)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    assert kernels.available(), kernels.unavailable_reason()
    torch.set_num_threads(args.threads)
    qt, isa = args.qtype, args.isa
    print(f"qtype {qt}, isa {kernels.isa(isa)}, gemm_rows_q8act body {torch.ops.tandem.gemm_rows_q8act_body(qt, isa)}, "
          f"{args.threads} thread(s), MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '-')}")
    amx = torch.ops.tandem.gemm_rows_q8act_body(qt, isa) == 3
    print("| N x K | M | linear_rows_q8act ms | gemm_rows_q8act ms |"
          + (" gemm_rows_q8act VNNI ms | AMX / VNNI |" if amx else "")
          + " MKL fp32 + dequantize ms | gemm_rows_q8act / MKL |")
    print("|---|---|---|---|" + ("---|---|" if amx else "") + "---|---|")
    for n, k in SHAPES:
        k = -(-k // 256) * 256 if qt in K_QUANTS else k      # K-quants: whole super-blocks (576 -> 768)
        q = blocks(n, k, qt, seed=1) if qt in K_QUANTS else weights(n, k, qt, seed=1)
        dense = q.dequantize()
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            gemv = best_ms(lambda: torch.ops.tandem.linear_rows_q8act(x, q.data, qt, k, None, isa))
            gemm = best_ms(lambda: torch.ops.tandem.gemm_rows_q8act(x, q.data, qt, k, None, isa))
            vnni = best_ms(lambda: torch.ops.tandem.gemm_rows_q8act(x, q.data, qt, k, None, 2)) if amx else 0.0
            mkl = best_ms(lambda: F.linear(x, dense)) + best_ms(lambda: torch.ops.tandem.dequantize_out(q.data, qt, k, dense))
            body = f" {vnni:.2f} | {vnni / gemm:.2f}x |" if amx else ""
            print(f"| {n} x {k} | {m} | {gemv:.2f} | {gemm:.2f} |{body} {mkl:.2f} | {mkl / gemm:.2f}x |")


if __name__ == "__main__":
    main()
