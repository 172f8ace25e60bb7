"""Extend steps on a cached shared prefix with the cascade attention (model/cascade.py) on and off: N requests
of `--own` new tokens each on one cached `--prefix`-token prompt prefix, max_tokens 1 (one prefill step),
best of `--reps`, engines with it on and off built alternately `--rounds` times.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/cascade_extend.py [--rows 12,31] [--json F]
"""
from __future__ import annotations

import argparse
import json
import random
import time

from tandem import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="12,31", help="request counts N, comma-separated")
    ap.add_argument("--prefix", type=int, default=900, help="tokens of the shared, cached prefix")
    ap.add_argument("--own", type=int, default=24, help="new tokens of each request after the prefix")
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per engine and N (best taken)")
    ap.add_argument("--rounds", type=int, default=2, help="engines built per setting, on and off alternating")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    res: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for on in (True, False):
            llm = LLM(shared_prefix_attention=on)
            vocab = llm.engine.model_config.vocab_size
            rng = random.Random(0)
            prefix = [rng.randrange(100, vocab) for _ in range(args.prefix)]
            one = SamplingParams(temperature=0, max_tokens=1)
            llm.generate([prefix + [7]], one, use_tqdm=False)          # the prefix enters the radix cache
            for n in map(int, args.rows.split(",")):
                best = float("inf")
                for _ in range(args.reps):
                    ps = [prefix + [rng.randrange(100, vocab) for _ in range(args.own)] for _ in range(n)]
                    t = time.perf_counter()
                    llm.generate(ps, one, use_tqdm=False)
                    best = min(best, time.perf_counter() - t)
                res.setdefault(f"{n} x {args.own} on {args.prefix} cached, cascade {'on' if on else 'off'}",
                               []).append(round(best * 1e3, 1))
            llm.shutdown()
    for k, v in res.items():
        print(f"{k}: {v} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
