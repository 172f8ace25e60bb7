"""Pipeline parallelism at equal cores: PP 2 x 1 thread against PP 1 x 2 threads, in one run (issue 20).

The real default model (SmolLM2-135M, 30 layers: 15 a stage). Three engines stay loaded and the rounds
alternate between them; each figure is the median of its rounds:
- throughput: 64 prompts x 32 tokens -> 128 output tokens each, output tok/s end to end;
- decode tok/s at batch B (1, 8, 64): B prompts of 32 tokens, (t(B x (1 + O)) - t(B x 1)) / (B x O), prefill
  subtracted out (benchmarks/tp.py's measure);
- the bubble fraction of PP 2 at each B: the share of stage time not spent on the forward,
  1 - (t_pp1x1 / 2) / t_pp2x1 per token, where PP 1 x 1 thread is the same forward on one core and each stage
  runs half of it on its own core. It counts the pipeline's idle time (batch 1 has one micro-batch: one stage
  always waits for the other) and the cost of the sends and the relay;
- the same measured directly: each stage's busy and send ms per decode step and its bubble fraction, from the
  stages' own spans (the trace's pp_stages).
PP 2 cuts the layers as pp_layer_partition="auto" does (measured: device/parallel/pp_split.py); --even adds PP 2 x 1
with the even cut to the rounds. Run under `flock /tmp/tandem-bench.lock`:
    python benchmarks/pp.py [--rounds 2] [--out 32] [--even] [--json benchmarks/results/pp.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.datasets import random_requests  # noqa: E402
from tp import cpu_flags, decode  # noqa: E402


def steal() -> int:
    """The host's CPU steal so far, in ticks (/proc/stat's 8th `cpu` number): printed beside each figure."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def throughput(llm, n: int = 64, prompt: int = 32, out: int = 128) -> float:
    prompts = [r.prompt for r in random_requests(n, prompt, 1, llm.engine.model_config.vocab_size, seed=7)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    return n * out / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per engine")
    ap.add_argument("--out", type=int, default=32, help="decode tokens per request of the batch-B figures")
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes, comma-separated")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--even", action="store_true", help="also run PP 2 x 1 with the even cut (pp_layer_partition "
                                                        "'even'), the split before the measured one")
    args = ap.parse_args()
    load_start = open("/proc/loadavg").read().split()[:3]
    kw = dict(kv_cache_tokens=16384, max_running_requests=64)
    engines = {"pp1x2": LLM(pp_size=1, device_threads=2, **kw), "pp2x1": LLM(pp_size=2, device_threads=1, **kw),
               "pp1x1": LLM(pp_size=1, device_threads=1, **kw)}
    if args.even:       # the cut before pp_layer_partition="auto" (15 + 15), in the same rounds
        engines["pp2x1_even"] = LLM(pp_size=2, device_threads=1, pp_layer_partition="even", **kw)
    cuts = {name: llm.engine.executor.pp_cut for name, llm in engines.items()}
    print("stage cuts:", cuts, flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    rounds: dict = {(n, b): [] for n in engines for b in batches + ["e2e"]}
    try:
        for llm in engines.values():               # warm-up: page in weights and the KV buffers
            decode(llm, max(batches), 4)
        for _ in range(args.rounds):
            for name, llm in engines.items():
                s0 = steal()
                rounds[(name, "e2e")].append({"tok_s": throughput(llm), "steal_ticks": steal() - s0})
                print(name, "e2e", rounds[(name, "e2e")][-1], flush=True)
            for b in batches:
                for name, llm in engines.items():
                    s0 = steal()
                    rounds[(name, b)].append({**decode(llm, b, args.out), "steal_ticks": steal() - s0})
                    print(name, b, round(rounds[(name, b)][-1]["tok_s"], 1), "steal", rounds[(name, b)][-1]["steal_ticks"],
                          flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    fig = {}
    for (name, b), rs in rounds.items():
        key = f"{name}_{b}" if b == "e2e" else f"{name}_b{b}"
        fig[key] = {"tok_s": statistics.median(r["tok_s"] for r in rs),
                    "tok_s_rounds": [round(r["tok_s"], 1) for r in rs], "steal_ticks": [r["steal_ticks"] for r in rs]}
    pp2 = [n for n in engines if n.startswith("pp2x1")]
    for n in pp2:
        fig[f"ratio{n[5:]}_e2e"] = fig[f"{n}_e2e"]["tok_s"] / fig["pp1x2_e2e"]["tok_s"]
    for b in batches:
        for n in pp2:
            fig[f"ratio{n[5:]}_b{b}"] = fig[f"{n}_b{b}"]["tok_s"] / fig[f"pp1x2_b{b}"]["tok_s"]
        # per token: t_pp2 = 1 / tok_s(pp2x1); ideal = t_pp1x1 / 2
        fig[f"bubble_b{b}"] = 1 - fig[f"pp2x1_b{b}"]["tok_s"] / (2 * fig[f"pp1x1_b{b}"]["tok_s"])
        # Measured directly: each stage's own spans over the decode steps (the trace's pp_stages), medians.
        per = [r["stages"] for r in rounds[("pp2x1", b)] if r.get("stages")]
        fig[f"stages_b{b}"] = [{key: statistics.median(p[k][key] for p in per)
                                for key in ("busy_ms_per_step", "comm_ms_per_step", "bubble_fraction")}
                               for k in range(len(per[0]))] if per else []
    result = {"model": "SmolLM2-135M-Instruct Q4_1 (the default GGUF), int8 activations", "cpu_flags": cpu_flags(),
              "stage_cuts": cuts,
              "cores": len(os.sched_getaffinity(0)), "rounds": args.rounds, "out": args.out, "figures": fig,
              "load_avg": {"start": load_start, "end": open("/proc/loadavg").read().split()[:3]}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
