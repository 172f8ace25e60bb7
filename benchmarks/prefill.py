"""Long-prompt throughput of tandem alone (issue 22's "long 16 x 1000 -> 64" workload, and item 1's int8 GEMM on
prefill): wall time of N prompts of L random tokens -> O greedy tokens through LLM.generate, the prompt
tokens per second of the prefill steps (from the step trace), for each kernels_act, interleaved rounds.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefill.py [--prompts 16 --len 1000 --out 64]

Run it with PYTHONPATH set to another checkout to compare two trees on one machine (the before / after of a
kernel change); prints one JSON line per (kernels_act, round) and a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, random, sys, time
from tandem import LLM, SamplingParams
n, length, out, act, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
llm = LLM(kernels_act=act, device_threads=int(sys.argv[6]))
vocab = llm.engine.model_config.vocab_size
rng = random.Random(seed)
prompts = [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]
sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
llm.generate([[5, 6, 7] * 40], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)   # warm-up
t = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
wall = time.perf_counter() - t
steps = [d for d in llm.engine.recorder.devices if d.num_tokens > d.batch_size]
prefill_tokens = sum(d.num_tokens for d in steps)
prefill_s = sum(d.end - d.start for d in steps)
print(json.dumps({"kernels_act": act, "wall_s": wall, "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else None,
                  "prefill_steps": len(steps)}))
llm.shutdown()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="number of prompts")
    ap.add_argument("--len", type=int, default=1000, help="tokens of each prompt")
    ap.add_argument("--out", type=int, default=64, help="greedy output tokens of each")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per kernels_act")
    ap.add_argument("--acts", default="int8,fp32", help="kernels_act values to run, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="device threads")
    args = ap.parse_args()
    res: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for act in args.acts.split(","):
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.prompts), str(args.len), str(args.out), act,
                                  str(r), str(args.threads)], capture_output=True, text=True, env=dict(os.environ))
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            res.setdefault(act, []).append(row)
    for act, rows in res.items():
        print(f"{act}: wall {statistics.median(r['wall_s'] for r in rows):.2f} s (median of {len(rows)}), prefill "
              f"{statistics.median(r['prefill_tok_s'] for r in rows):.0f} prompt tok/s")


if __name__ == "__main__":
    main()
