"""Where a long prefill's time goes with prefill_act="int8" (the int8 GEMM gemm_rows_q8act and fp32 SDPA) and "bf16"
(oneDNN's bf16 GEMM, AMX tiles where the CPU has them, and bf16 SDPA): one prompt of --len tokens prefilled
in one chunk, the engine inline (the executor in this process) so torch.profiler sees every op.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefill_bf16.py [--len 924] [--rounds 3]

Each round builds both engines' runs in alternating order, untraced wall times first (median of --reps
prefills each, fresh prompts: no prefix-cache hit), then one profiled prefill. Writes
benchmarks/results/prefill_bf16.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from tandem import LLM, SamplingParams
from tandem.bench import machine_info, write_json_md
from tandem.bench.datasets import random_requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import cpu_flags  # noqa: E402

FAMILIES = [  # (family, op-name predicate), first match wins
    ("linears (gemm_rows_q8act / bf16 mm)", lambda n: n in ("tandem::gemm_rows_q8act", "aten::mm", "aten::addmm",
                                                      "tandem::gemv_packed_q8act", "tandem::linear_rows_q8act")),
    ("attention (SDPA flash)", lambda n: "flash_attention" in n),
    ("dtype conversions (copy_)", lambda n: n == "aten::copy_"),
    ("SiLU x up", lambda n: n in ("aten::silu", "aten::mul", "tandem::silu_mul")),
    ("norms", lambda n: "rms_norm" in n),
    ("KV writes and gathers", lambda n: n in ("aten::index", "aten::_index_put_impl_")),
    ("rope", lambda n: n == "tandem::rope_"),
]


def family(name: str) -> str:
    return next((f for f, pred in FAMILIES if pred(name)), "other ops")


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return random_requests(1, n, 1, vocab, 0.0, seed)[0].prompt


def measure(llm: LLM, n: int, reps: int, seed: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    walls = []
    for r in range(reps):
        p = prompt(vocab, n, seed + r)
        t = time.perf_counter()
        llm.generate([p], sp, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    with torch.profiler.profile() as prof:
        llm.generate([prompt(vocab, n, seed + reps)], sp, use_tqdm=False)
    fam: dict[str, float] = {}
    for e in prof.key_averages():
        fam[family(e.key)] = fam.get(family(e.key), 0.0) + e.self_cpu_time_total / 1e3
    return {"wall_s": statistics.median(walls), "profiled_ms": fam}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--len", type=int, default=924, help="prompt tokens (one chunk: max_prefill_tokens follows)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the two settings alternating")
    ap.add_argument("--reps", type=int, default=3, help="untraced prefills per setting and round (median)")
    ap.add_argument("--threads", type=int, default=2, help="device threads")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "prefill_bf16"), help="result path without extension")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llms = {act: LLM(device_backend="inline", device_threads=args.threads, prefill_act=act,
                     max_prefill_tokens=max(2048, args.len), prefix_cache=False) for act in ("int8", "bf16")}
    for llm in llms.values():                          # warm: oneDNN's kernels, the buffers
        measure(llm, args.len, 1, 10 ** 6)
    runs: dict[str, list[dict]] = {act: [] for act in llms}
    for r in range(args.rounds):
        for act in (("int8", "bf16") if r % 2 == 0 else ("bf16", "int8")):
            runs[act].append(measure(llms[act], args.len, args.reps, 1000 * r + 10))
            print(act, r, f"{runs[act][-1]['wall_s']:.3f} s", file=sys.stderr)
    for llm in llms.values():
        llm.shutdown()
    fams = sorted({f for rs in runs.values() for x in rs for f in x["profiled_ms"]},
                  key=lambda f: -max(statistics.median(x["profiled_ms"].get(f, 0.0) for x in rs) for rs in runs.values()))
    summary = {act: {"wall_s": statistics.median(x["wall_s"] for x in rs),
                     "profiled_ms": {f: round(statistics.median(x["profiled_ms"].get(f, 0.0) for x in rs), 1)
                                     for f in fams}} for act, rs in runs.items()}
    ratio = summary["int8"]["wall_s"] / summary["bf16"]["wall_s"]
    cmd = "flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefill_bf16.py " + " ".join(sys.argv[1:])
    lines = [f"# A {args.len}-token prefill: prefill_act int8 against bf16", "",
             f"`{cmd.strip()}`; default model (SmolLM2-135M Q4_1), one chunk, {args.threads} threads, engine "
             f"inline; CPU: {cpu_flags()}. Wall: median over {args.rounds} rounds (alternating order) of the "
             f"median of {args.reps} untraced prefills; ops: torch.profiler self time of one prefill a round "
             f"(median), ms.", "",
             "| | prefill_act=int8 | prefill_act=bf16 |", "|---|---|---|",
             f"| wall, s (untraced) | {summary['int8']['wall_s']:.3f} | {summary['bf16']['wall_s']:.3f} |"]
    lines += [f"| {f}, ms | {summary['int8']['profiled_ms'][f]} | {summary['bf16']['profiled_ms'][f]} |"
              for f in fams]
    lines += ["", f"bf16 / int8 speed: **{ratio:.2f}x**."]
    write_json_md(args.out + ".json", {"command": cmd.strip(), "machine": machine_info(args.threads), "flags": cpu_flags(),
                             "len": args.len, "rounds": runs, "summary": summary, "speedup": round(ratio, 3)},
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
