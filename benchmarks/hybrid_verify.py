"""Speculative decoding on a hybrid model: what taking a verify run's rejected drafts back out of the linear-attention
state costs (model/verify_runs.py: the state before the run kept, the kept tokens replayed), against keeping a state
per position of the run (the other way: k + 1 copies of the state a step), on the Qwen3.6-35B-A3B-shaped file.

One request, greedy, serial loop, the device inline (so its time is this process's): TPOT of plain decode, of
verify steps whose k drafts are all accepted (a proposer that knows the plain output: the state kept, nothing
replayed) and all rejected (random drafts: each step replays one token). Beside them, the time of the record and
the replay a verify step spends (the layers' before_conv / before_rule and roll_back, timed), and a per-position
copy scheme's time measured on the same pool: k + 1 copies of a row's state. CPU steal printed beside each run.

    .venv/bin/python benchmarks/hybrid_verify.py --json benchmarks/results/hybrid_verify.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT = os.path.expanduser("~/.cache/tandem/models/qwen3.6-35b-a3b-4l-q4km.gguf")


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


class Timed:
    """Wraps a method to add its wall time to `total` (seconds) and count its calls."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.orig = owner, name, getattr(owner, name)
        self.total, self.calls = 0.0, 0
        timed = self

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return timed.orig(*a, **kw)
            finally:
                timed.total += time.perf_counter() - t
                timed.calls += 1
        setattr(owner, name, wrapper)


def tpot(llm, prompt, n, params) -> float:
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT, help="the hybrid GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="device threads")
    ap.add_argument("--k", type=int, default=4, help="drafts a verify step carries")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated a run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the three modes alternating in each")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import torch
    import tandem.scheduler.speculative as spec_mod
    from tandem import LLM, SamplingParams
    from tandem.model import linear_attention, verify_runs
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": 8}
    llm = LLM(args.model, device_threads=args.threads, device_backend="inline", scheduler="serial",
              max_running_requests=4, max_model_len=2048, speculative_config=spec)
    sched = llm.engine.scheduler
    sched.spec.observe_step = lambda *a, **kw: None               # always draft k (the adaptive rule off)
    sched.spec.row_cost = 0.0
    prompt = [random.Random(0).randrange(1000, 200000) for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.engine.config = llm.engine.config.replace(speculative_config=None)
    truth = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    rng = random.Random(1)

    def oracle(req, k, lo, hi):
        n = len(req.output_ids) + len(req.spec.guess)
        return list(truth[n:n + k]) or [rng.randrange(1000, 200000)]

    def garbage(req, k, lo, hi):
        return [rng.randrange(1000, 200000) for _ in range(k)]

    timers = [Timed(verify_runs.VerifyRuns, "before_conv"), Timed(verify_runs.VerifyRuns, "before_rule"),
              Timed(linear_attention.GatedDeltaNet, "roll_back")]
    rows: dict[str, list] = {"plain": [], "accepted": [], "rejected": []}
    nlin = len(llm.engine.model_config.linear_layers)
    for r in range(args.rounds):
        for mode in rows:
            llm.engine.config = llm.engine.config.replace(speculative_config=None if mode == "plain" else spec)
            spec_mod.ngram_drafts = oracle if mode == "accepted" else garbage
            for t in timers:
                t.total, t.calls = 0.0, 0
            s0 = steal()
            s = tpot(llm, prompt, args.tokens, params)
            verifies = max(1, timers[2].calls // nlin)      # roll_back: once a linear layer a verify step
            rec = sum(t.total for t in timers[:2]) * 1e3 / verifies
            back = timers[2].total * 1e3 / verifies
            rows[mode].append({"tpot_ms": s * 1e3, "record_ms_per_verify": rec, "replay_ms_per_verify": back,
                               "steal": steal() - s0})
            print(f"round {r} {mode:9s} TPOT {s * 1e3:7.2f} ms  record {rec:.3f} ms  replay {back:.3f} ms a verify "
                  f"step  steal {steal() - s0}", flush=True)
    pool = llm.engine.executor.model_runner.recurrent
    conv, ssm = torch.empty_like(pool.conv[:, 0]), torch.empty_like(pool.ssm[:, 0])
    copies = []
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(args.k + 1):          # a state per position: the row's whole state copied each token
            conv.copy_(pool.conv[:, 1])
            ssm.copy_(pool.ssm[:, 1])
        copies.append((time.perf_counter() - t) * 1e3)
    med = {m: statistics.median(x["tpot_ms"] for x in v) for m, v in rows.items()}
    out = {"model": os.path.basename(args.model), "k": args.k, "threads": args.threads, "rounds": rows,
           "median_tpot_ms": med, "per_position_copies_ms": statistics.median(copies),
           "state_mb_per_row": (pool.conv[:, 0].numel() + pool.ssm[:, 0].numel()) * 4 / 1e6,
           "torch": torch.__version__}
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
