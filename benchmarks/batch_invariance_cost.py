"""What batch invariance costs: tandem with batch_invariant on (the default: every token attends with the decode op's
arithmetic, a chunk's tokens by the causal op in GEMM form) and off (a chunk's size picks its path, long chunks the
extend op), on the workloads of prefix_vs_vllm.py (the vLLM
comparison's tandem side: shared-prefix, multi-turn, long, decode = `tandem bench offline` 64 x 32 -> 128) and
single-stream TPOT (1 x 32 -> 256). Both engines live in this process (each with its device process), rounds
interleaved, the order within a round alternating; fresh prompts each round. Prints the median wall time of
each and the ratio on / off (> 1: invariance costs that much).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/batch_invariance_cost.py --json results/x.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from prefix_vs_vllm import WORKLOADS, requests_for, run_tandem

from tandem import LLM, SamplingParams
from tandem.bench import machine_info
from tandem.bench.datasets import random_requests
from tandem.bench.offline import warm_up


def tpot(llm, seed: int) -> float:
    """Seconds per output token of one 32 -> 256 greedy stream (wall over tokens after the first)."""
    import time
    (r,) = random_requests(1, 32, 256, llm.engine.model_config.vocab_size, 0.0, seed)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([r.prompt], sp, use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([r.prompt], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - t - first) / 255


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS + ("tpot",)),
                    help="comma-separated, of " + ", ".join(WORKLOADS + ("tpot",)))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median taken)")
    ap.add_argument("--json", default=None, help="write every round's figures and the summary here")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default SmolLM2 Q4_1), e.g. a larger "
                    "shape written by big_models.py")
    args = ap.parse_args()
    engines = {on: LLM(args.model, batch_invariant=on) for on in (True, False)}
    for llm in engines.values():
        warm_up(llm)
    vocab = engines[True].engine.model_config.vocab_size
    runs: dict[str, dict[bool, list[float]]] = {}
    for r in range(args.rounds):
        for w in args.workloads.split(","):
            order = (True, False) if r % 2 == 0 else (False, True)
            for on in order:
                if w == "tpot":
                    secs = tpot(engines[on], 1000 + r)
                else:
                    secs = run_tandem(engines[on], w, requests_for(w, vocab, 1000 + r))[0]
                runs.setdefault(w, {True: [], False: []})[on].append(secs)
                print(json.dumps({"round": r, "workload": w, "batch_invariant": on, "seconds": secs}), flush=True)
    summary = {w: {"on_s": statistics.median(v[True]), "off_s": statistics.median(v[False]),
                   "on_over_off": statistics.median(v[True]) / statistics.median(v[False])} for w, v in runs.items()}
    for w, s in summary.items():
        print(f"{w:14s} on {s['on_s']:.4f} s  off {s['off_s']:.4f} s  on/off {s['on_over_off']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            model = None if args.model is None else os.path.basename(args.model)
            json.dump({"machine": machine_info(), "model": model, "rounds": runs, "summary": summary}, f, indent=1,
                      default=str)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
