"""`tandem trace`: one workload through the serial and the overlap loop, written out as a trace folder.

  tandem trace --out traces/smollm2 --requests 16 --max-tokens 16 --input-len 32
writes summary.json, trace.json (Perfetto / chrome://tracing), timeline.png and report.html into --out.
"""
from __future__ import annotations

import argparse
import dataclasses


def add_parser(subparsers) -> None:
    from ..cli import add_engine_args
    p = subparsers.add_parser("trace", help="trace the serial and overlap loops on one workload",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for summary.json, trace.json, timeline.png, report.html")
    p.add_argument("--requests", type=int, default=16, help="number of prompts")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos, greedy)")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens (seeded random ids)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternating rounds per loop (tokens/s median over rounds; the last round is traced)")
    p.add_argument("--overhead-rounds", type=int, default=0,
                   help="also measure tokens/s with the recorder on vs off over this many rounds")
    add_engine_args(p)
    p.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    from ..cli import engine_config
    from ..llm import LLM
    from .export import write_trace_dir
    from .summary import summarize
    from .run import Workload, recording_overhead, trace_loops
    for name in ("requests", "max_tokens", "input_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    config = engine_config(args).replace(trace_dir=None)     # this command writes its own folder
    workload = Workload(args.requests, args.max_tokens, args.input_len, args.workload_seed)
    llm = LLM(**dataclasses.asdict(config))
    try:
        recs, tps = trace_loops(llm, workload, args.rounds)
        overhead = recording_overhead(llm, workload, args.overhead_rounds) if args.overhead_rounds else None
        name = llm.engine.model_name
    finally:
        llm.shutdown()
    meta = {"model": name, "workload": dataclasses.asdict(workload), "rounds": args.rounds,
            "config": {k: v for k, v in dataclasses.asdict(config).items() if k not in ("scheduler", "trace_dir")}}
    if overhead is not None:
        meta["recording_overhead"] = overhead
    summary = summarize(recs, tps, **meta)
    paths = write_trace_dir(args.out, recs, summary, f"tandem trace: {name}, serial vs overlap")
    for loop, s in summary["loops"].items():
        print(f"{loop:8s} {s['tokens_per_s']:8.1f} tok/s  device idle {100 * s['device_idle_fraction']:5.1f} %  "
              f"host {s['host_ms_per_step']:.2f} ms  device {s['device_ms_per_step']:.2f} ms per step  "
              f"({s['steps']} steps)")
    print(f"overlap/serial tokens/s {summary['overlap_speedup']:.2f} "
          f"(bound (host+device)/max(host,device) {summary['overlap_speedup_bound']:.2f})")
    if summary["overlap_speedup_check"] != "ok":
        print(f"warning: {summary['overlap_speedup_check']}")
    if overhead is not None:
        print(f"recording overhead {100 * overhead['overhead_fraction']:+.1f} % "
              f"({overhead['median_on']:.1f} vs {overhead['median_off']:.1f} tok/s; scheduler CPU "
              f"{overhead['host_cpu_us_per_token_on']:.1f} vs {overhead['host_cpu_us_per_token_off']:.1f} us/token)")
    print("wrote " + ", ".join(paths.values()))
    return 0
