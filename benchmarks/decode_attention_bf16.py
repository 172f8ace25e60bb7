"""The native decode op with bf16 products (decode_attention="bf16": vdpbf16ps on the queries' and probabilities'
bf16 pairs, csrc/decode_attention_bf16.inc) next to its fp32 products, on SmolLM2-135M's heads (9 over 3 KV heads,
head_dim 64, bf16 cache, 30 layers' slots), the batches a server meets, interleaved in one process, best of --reps.
Needs AVX512-BF16 (elsewhere the flag runs the fp32 body).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/decode_attention_bf16.py [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention_chunks import batch  # noqa: E402
from tandem import kernels  # noqa: E402
from tandem.bench import interleaved_best, machine_info, write_json_md  # noqa: E402

BATCHES = {  # name: (own keys of each row, keys of a prefix they all share)
    "64 rows of 100-220 keys (decode workload)": ("random", 64, 100, 220, 0),
    "32 rows, 930-key shared prefix + 24 (shared-prefix workload)": ("fixed", 32, 24, 24, 930),
    "16 rows of 300-900": ("random", 16, 300, 900, 0),
    "8 rows of 3,000 (long workload's decode)": ("fixed", 8, 3000, 3000, 0),
    "1 row of 2,000": ("fixed", 1, 2000, 2000, 0),
}


def case(spec: tuple, bf16: bool, g: torch.Generator):
    kind, b, lo, hi, prefix = spec
    own = [int(x) for x in torch.randint(lo, hi + 1, (b,), generator=g)] if kind == "random" else [lo] * b
    q, cache, kv_index, lens = batch(own, prefix, g)
    return lambda: torch.ops.tandem.decode_attention(q, cache, 3, kv_index, lens, 0.125, -1, -1, 0, bf16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the op")
    ap.add_argument("--reps", type=int, default=40, help="interleaved timed rounds; the best counts")
    ap.add_argument("--json", default=None, help="write the results here (and the table beside it, .md)")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("native kernels unavailable")
    if not (kernels.isa() == "avx512" and torch.cpu._is_avx512_bf16_supported()):
        raise SystemExit("this CPU lacks AVX512-BF16: the flag would run the fp32 body")
    torch.set_num_threads(args.threads)
    rows = []
    lines = ["| batch (one layer's attention) | fp32 products, ms | bf16 products, ms | fp32 / bf16 |", "|---|---|---|---|"]
    for name, spec in BATCHES.items():
        fns = [case(spec, bf16, torch.Generator().manual_seed(0)) for bf16 in (False, True)]
        fp32, bf16 = interleaved_best(fns, args.reps)
        rows.append({"batch": name, "fp32_ms": 1e3 * fp32, "bf16_ms": 1e3 * bf16, "ratio": fp32 / bf16})
        lines.append(f"| {name} | {1e3 * fp32:.3f} | {1e3 * bf16:.3f} | {fp32 / bf16:.2f}x |")
        print(lines[-1], flush=True)
    info = machine_info(args.threads)
    md = (f"# The decode op's bf16 products (`decode_attention`, issue 22)\n\n`benchmarks/decode_attention_bf16.py`, "
          f"{args.threads} threads, best of {args.reps} interleaved rounds, bf16 cache, SmolLM2-135M's heads; "
          f"{info['cpu_model']}.\n\n" + "\n".join(lines) + "\n")
    if args.json:
        write_json_md(args.json, {"machine": info, "results": rows}, md)


if __name__ == "__main__":
    main()
