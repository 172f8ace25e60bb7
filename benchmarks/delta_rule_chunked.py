"""The delta rule's chunked op (csrc/gated_delta_rule_chunked.cpp, chunks of 32 and of 64 tokens) against the
recurrent op (csrc/gated_delta_rule.cpp) on Qwen3.6-35B-A3B's linear-attention heads (16 key heads serving 32
value heads, Dk = Dv = 128): one layer's prefill rows, one row of 512 tokens and four of 128, each row fresh.

The ops run one after another in rounds (a drifting or shared machine slows a round's ops alike), for each SIMD
body this CPU has; each round prints its times and the CPU steal over it (/proc/stat's 8th `cpu` number, in
ticks); the median over the rounds counts, the best rounds' ratio beside it.

    .venv/bin/python benchmarks/delta_rule_chunked.py [--threads 2] [--rounds 7]
        [--json benchmarks/results/delta_rule_chunked.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem import kernels  # noqa: E402
from tandem.bench import machine_info, write_json_md  # noqa: E402
from tandem.model.linear_attention import l2norm  # noqa: E402

HK, HV, D = 16, 32, 128
CASES = {"1 x 512": [512], "4 x 128": [128] * 4}
CHUNKS = (32, 64)
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
         "amx_bf16", "amx_int8")


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def lscpu() -> tuple[str, list[str]]:
    """lscpu's model name and which of FLAGS the CPU has."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return fields.get("Model name", "?").strip(), [f for f in FLAGS if f in flags]


def ops(lens: list[int], isa: int) -> dict:
    """The ops on one layer's rows (slots 0.., each fresh), by name."""
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    q = l2norm(torch.randn(t, HK, D, generator=g)) * D ** -0.5
    k = l2norm(torch.randn(t, HK, D, generator=g))
    v = torch.randn(t, HV, D, generator=g)
    gate = -F.softplus(torch.randn(t, HV, generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(t, HV, generator=g))
    state = torch.zeros(len(lens), HV, D, D)
    slots = torch.arange(len(lens))
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens) + 1)])
    fresh = torch.ones(len(lens), dtype=torch.bool)
    args = (q, k, v, gate, beta, state, slots, starts, fresh)
    out = {"recurrent": lambda: torch.ops.tandem.gated_delta_rule_(*args, isa)}
    for c in CHUNKS:
        out[f"chunked {c}"] = lambda c=c: torch.ops.tandem.gated_delta_rule_chunked_(*args, c, isa)
    return out


def rounds(fns: dict, n: int, label: str) -> list[dict]:
    """n rounds of every op once (after a warm-up call each), printed as they go."""
    for f in fns.values():
        f()
    out = []
    for r in range(n):
        s0, row = steal(), {}
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            row[name] = (time.perf_counter() - t0) * 1e3
        row["steal_ticks"] = steal() - s0
        out.append(row)
        print(f"{label} round {r}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items() if k != "steal_ticks")
              + f"; steal {row['steal_ticks']} ticks", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every op (at least 5)")
    ap.add_argument("--json", default=None, help="write the figures here (and the table beside it, .md)")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("native kernels unavailable")
    torch.set_num_threads(args.threads)
    model, flags = lscpu()
    summary = []
    lines = ["| body | rows | recurrent, ms | " + " | ".join(f"chunked {c}, ms | recurrent / chunked {c}"
                                                          for c in CHUNKS)
             + f" | best rounds' ratio, {' / '.join(map(str, CHUNKS))} | steal, ticks |",
             "|---|---|---|" + "---|---|" * len(CHUNKS) + "---|---|"]
    for isa in [i for i in (2, 1) if i <= torch.ops.tandem.isa(2)]:
        body = kernels.ISA_NAMES[isa]
        for case, lens in CASES.items():
            rs = rounds(ops(lens, isa), max(args.rounds, 5), f"{body} {case}")
            names = [name for name in rs[0] if name != "steal_ticks"]
            med = {name: statistics.median(r[name] for r in rs) for name in names}
            best = {name: min(r[name] for r in rs) for name in names}
            ratios = {c: med["recurrent"] / med[f"chunked {c}"] for c in CHUNKS}
            best_ratios = {c: best["recurrent"] / best[f"chunked {c}"] for c in CHUNKS}
            stolen = sum(r["steal_ticks"] for r in rs)
            summary.append({"body": body, "rows": case, "median_ms": med, "ratio": ratios, "best_ms": best,
                            "best_ratio": best_ratios, "steal_ticks": stolen, "rounds": rs})
            lines.append(f"| {body} | {case} | {med['recurrent']:.2f} | " + " | ".join(
                f"{med[f'chunked {c}']:.2f} | {ratios[c]:.2f}x" for c in CHUNKS)
                + f" | {' / '.join(f'{best_ratios[c]:.2f}x' for c in CHUNKS)} | {stolen} |")
    info = machine_info(args.threads)
    md = ("# The delta rule: chunked op against the recurrent op\n\n"
          f"`benchmarks/delta_rule_chunked.py --threads {args.threads} --rounds {args.rounds}`: one linear layer "
          f"of Qwen3.6-35B-A3B ({HK} key heads, {HV} value heads, Dk = Dv = {D}), fresh rows; the median of "
          f"{args.rounds} rounds that run the ops one after another. CPU: {model} ({info['nproc']} cores); "
          f"flags: {', '.join(flags)}.\n\n" + "\n".join(lines) + "\n")
    if args.json:
        write_json_md(args.json, {"machine": {**info, "lscpu_model": model, "flags": flags}, "cases": summary}, md)
    else:
        print(md)


if __name__ == "__main__":
    main()
