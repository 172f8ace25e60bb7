"""kernels="native" against kernels="torch" on the default model, in one run (issue 11's figures).

Both engines stay loaded and every measurement alternates between them round by round (this machine drifts
between rounds; ARCHITECTURE.md section 5), each figure the median of its rounds:
- TPOT@128 and TPOT@2k: one request, (t(1 + O tokens) - t(1 token)) / O, prompt of 128 / 2000 tokens;
- batch 64: 64 prompts x 32 in -> 128 out, output tok/s through the overlap loop;
- prefill: 8 prompts x 512 tokens, 1 output token, input tok/s;
- device RSS: resident memory of the device process after the runs (weights + touched KV + torch itself).
Run under `flock /tmp/tandem-bench.lock` so no other benchmark shares the cores.
    python benchmarks/kernel_engines.py [--rounds 3] [--threads N] [--engines native,torch] [--json out.json]
--engines names two or more of: native, torch, int8 (native with kernels_act="int8"); ratios are to the first.
--agreement N (not timed) instead decodes N greedy tokens of a few prompts with native and int8 and reports
where they first differ.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

from tandem import LLM, SamplingParams
from tandem.bench.datasets import random_requests


def generate_s(llm, prompts: list[list[int]], out: int) -> float:
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def tpot_ms(llm, prompt_len: int, out: int = 64) -> float:
    p = [random_requests(1, prompt_len, 1, llm.engine.model_config.vocab_size, seed=prompt_len)[0].prompt]
    return (generate_s(llm, p, 1 + out) - generate_s(llm, p, 1)) / out * 1e3


def batch_tok_s(llm, n: int = 64, n_in: int = 32, n_out: int = 128) -> float:
    reqs = random_requests(n, n_in, n_out, llm.engine.model_config.vocab_size, seed=1)
    return n * n_out / generate_s(llm, [r.prompt for r in reqs], n_out)


def prefill_tok_s(llm, n: int = 8, n_in: int = 512) -> float:
    reqs = random_requests(n, n_in, 1, llm.engine.model_config.vocab_size, seed=2)
    return n * n_in / generate_s(llm, [r.prompt for r in reqs], 1)


def device_rss_mb(llm) -> float:
    with open(f"/proc/{llm.engine.executor.proc.pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


METRICS = {"TPOT@128 ms": lambda llm: tpot_ms(llm, 128), "TPOT@2k ms": lambda llm: tpot_ms(llm, 2000),
           "batch 64 tok/s": batch_tok_s, "prefill tok/s": prefill_tok_s}


ENGINES = {"native": dict(kernels="native"), "torch": dict(kernels="torch"),
           "int8": dict(kernels="native", kernels_act="int8")}
AGREEMENT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time",
                     "The best way to learn a language is", "import numpy as np\n", "Water boils at",
                     "List three colors:")


def agreement(n_tokens: int) -> dict:
    """Greedy tokens of native (fp32 activations) and int8: per prompt, the first index where they differ."""
    outs = {}
    for name in ("native", "int8"):
        llm = LLM(**ENGINES[name], device_backend="inline")
        prompts = [llm.tokenizer.encode(t) for t in AGREEMENT_PROMPTS]
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True),
                           use_tqdm=False)
        outs[name] = [r.token_ids for r in res]
        llm.shutdown()
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
             for x, y in zip(outs["native"], outs["int8"])]
    same = sum(n_tokens if f is None else f for f in first)
    print(f"greedy agreement int8 vs fp32 activations: {sum(f is None for f in first)}/{len(first)} prompts "
          f"identical over {n_tokens} tokens; first divergence per prompt {first}; "
          f"{same}/{n_tokens * len(first)} tokens before the first divergence")
    return {"tokens": n_tokens, "first_divergence": first, "identical_prompts": sum(f is None for f in first)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="device_threads (default: the engine's)")
    ap.add_argument("--engines", default="native,torch", help="comma-separated: native, torch, int8")
    ap.add_argument("--agreement", type=int, default=0, help="greedy tokens of the int8 agreement check")
    ap.add_argument("--metrics", default=",".join(METRICS), help="comma-separated subset of: " + ", ".join(METRICS))
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.agreement:
        result = agreement(args.agreement)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    metrics = {m: METRICS[m] for m in args.metrics.split(",") if m in METRICS}
    if len(metrics) != len(args.metrics.split(",")):
        raise SystemExit(f"--metrics: a subset of {', '.join(METRICS)}, got {args.metrics!r}")
    names = args.engines.split(",")
    if len(names) < 2 or any(n not in ENGINES for n in names):
        raise SystemExit(f"--engines: two or more of {', '.join(ENGINES)}, got {args.engines!r}")
    llms = {k: LLM(**ENGINES[k], max_running_requests=64, kv_cache_tokens=16384, device_threads=args.threads)
            for k in names}
    try:
        for llm in llms.values():                       # first-forward costs stay out of the timed rounds
            batch_tok_s(llm, 8, 16, 4)
            prefill_tok_s(llm, 2, 64)
        rounds: dict[str, dict[str, list[float]]] = {k: {m: [] for m in metrics} for k in llms}
        for r in range(args.rounds):
            for name, fn in metrics.items():
                for k in (names if r % 2 == 0 else names[::-1]):
                    rounds[k][name].append(fn(llms[k]))
        result = {k: {m: statistics.median(v) for m, v in rounds[k].items()} for k in llms}
        for k, llm in llms.items():
            result[k]["device RSS MB"] = device_rss_mb(llm)
            result[k]["rounds"] = rounds[k]
    finally:
        for llm in llms.values():
            llm.shutdown()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    threads = next(iter(llms.values())).engine.device_threads
    print(f"device threads {threads}, {args.rounds} alternating rounds, medians")
    base = names[0]
    print(f"{'metric':16} " + " ".join(f"{k:>10}" for k in names) + " " +
          " ".join(f"{k + '/' + base:>14}" for k in names[1:]))
    for m in [*metrics, "device RSS MB"]:
        print(f"{m:16} " + " ".join(f"{result[k][m]:10.2f}" for k in names) + " " +
              " ".join(f"{result[k][m] / result[base][m]:13.2f}x" for k in names[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result, "threads": threads, "lscpu": flags}, f, indent=1)


if __name__ == "__main__":
    main()
