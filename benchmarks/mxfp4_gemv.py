"""MXFP4 against Q4_0 on gpt-oss-20b's expert shapes (hidden 2880, expert width 2880: gate_up [5760, 2880], down [2880,
2880]): the int8 linear at a decode row count (the GEMV: linear_rows_q8act, which on AVX-512 VNNI runs
gemv_rows_q8act for MXFP4 and its own decode body for Q4_0) and at a prefill-chunk row count (gemm_rows_q8act), on
the row layout both types share; and the packed GEMV (gemv_packed_q8act on the copy pack_gemv makes at load, what a
model's decode steps and moe_experts run) at the decode row count. The two types alternate in each round, so a noisy
neighbour hits both; each round prints its times and the CPU steal over it (/proc/stat, 8th field of the cpu line).
Weights are random blocks (the time does not depend on the values).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/mxfp4_gemv.py [--threads 2] [--rounds 5]
    writes benchmarks/results/mxfp4_gemv.json (mxfp4_gemv.md beside it reads a run)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.packed_gemv import cpu_flags  # noqa: E402

from tandem import kernels  # noqa: E402
from tandem.kernels.quant import BLOCK_BYTES, MXFP4, Q4_0, QuantWeight  # noqa: E402

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def random_weight(n: int, k: int, qtype: int, rng: np.random.Generator) -> QuantWeight:
    """Random GGUF blocks with a sane scale (fp16 d ~0.01 for Q4_0, exponents 120-123 for MXFP4)."""
    b = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == MXFP4:
        b[..., 0] = rng.integers(120, 124, b.shape[:2], dtype=np.uint8)
    else:
        b[..., 0:2] = np.full(b.shape[:2] + (1,), 0.01, np.float16).view(np.uint8)
    return QuantWeight.from_gguf(torch.from_numpy(b.reshape(n, -1)), qtype, k)


def cpu_ticks() -> tuple[int, int]:
    """(steal, busy ticks of other processes): the cpu line's 8th number, and its user + nice + system less this
    process's own (the machine's cores are shared: a neighbour's load is not steal but slows a round as much)."""
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:9]]         # user nice system idle iowait irq softirq steal
    own = sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK")
    return v[7], v[0] + v[1] + v[2] - round(own)


def time_ms(f, calls: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(calls):
        f()
    return 1e3 * (time.perf_counter() - t) / calls


def cases(rows_gemv: int, rows_gemm: int) -> dict:
    """name -> {qtype: callable}: every shape x op, each with both types' weights and one x."""
    rng, out = np.random.default_rng(0), {}
    for shape, (n, k) in SHAPES.items():
        w = {qt: random_weight(n, k, qt, rng) for qt in (MXFP4, Q4_0)}
        for op, m in (("gemv", rows_gemv), ("gemm", rows_gemm)):
            x = torch.randn(m, k)
            fn = torch.ops.tandem.linear_rows_q8act if op == "gemv" else torch.ops.tandem.gemm_rows_q8act
            out[f"{shape} {op} M={m}"] = {qt: (lambda fn=fn, x=x, q=q: fn(x, q.data, q.qtype, q.k, None))
                                          for qt, q in w.items()}
        x = torch.randn(rows_gemv, k)
        for qt in (MXFP4, Q4_0):
            packed = torch.ops.tandem.pack_gemv(w[qt].data, qt, k)
            out[f"{shape} packed M={rows_gemv}"] = out.get(f"{shape} packed M={rows_gemv}", {})
            out[f"{shape} packed M={rows_gemv}"][qt] = lambda p=packed, x=x, n=n, k=k, qt=qt: (
                torch.ops.tandem.gemv_packed_q8act(x, p, qt, k, n, None))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows-gemv", type=int, default=1)
    p.add_argument("--rows-gemm", type=int, default=128, help="past small_m(): the GEMM's row count")
    args = p.parse_args()
    assert kernels.available(), kernels.unavailable_reason()
    torch.set_num_threads(args.threads)
    table = cases(args.rows_gemv, args.rows_gemm)
    times = {case: {str(v): [] for v in fns} for case, fns in table.items()}
    steal, others = [], []
    for r in range(args.rounds):
        s0, o0 = cpu_ticks()
        for case, fns in table.items():
            calls = 3 if "gemm" in case else 20
            for v, f in fns.items():
                times[case][str(v)].append(time_ms(f, calls))
        s1, o1 = cpu_ticks()
        steal.append(s1 - s0), others.append(o1 - o0)
        row = "  ".join(f"{c}: " + " ".join(f"{t[-1]:.3f}" for t in times[c].values()) for c in table)
        print(f"round {r}: steal {steal[-1]} ticks, others {others[-1]} ticks  {row}", flush=True)
    names = {str(MXFP4): "MXFP4", str(Q4_0): "Q4_0"}
    summary = {case: {names[v]: statistics.median(t) for v, t in ts.items()} for case, ts in times.items()}
    result = {"cpu": cpu_flags(), "threads": args.threads, "rounds": args.rounds, "steal_ticks": steal,
              "other_processes_ticks": others,
              "ms_per_round": {c: {names[v]: t for v, t in ts.items()} for c, ts in times.items()},
              "median_ms": summary,
              "mxfp4_over_q4_0": {c: s["MXFP4"] / s["Q4_0"] for c, s in summary.items()}}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "mxfp4_gemv.json"), "w") as f:
        json.dump(result, f, indent=1)
    for c, s in summary.items():
        times_ms = ", ".join(f"{v} {t:.3f} ms" for v, t in s.items())
        print(f"{c}: {times_ms}; MXFP4 / Q4_0 {s['MXFP4'] / s['Q4_0']:.2f}")


if __name__ == "__main__":
    main()
