"""An MoE model over tensor-parallel ranks: how its experts are split (issue 43: "experts sharded by their
intermediate dimension, or whole experts per rank: measure and choose").

The file: benchmarks/big_models.py's Qwen3-30B-A3B shape (128 experts, top-8, expert width 768, Q4_K_M, llama.cpp's
type mix) with --layers layers. Each engine runs in its own process, one after the other, rounds alternating:
- this checkout at tp 2 x 1 thread (shard.py's choice: whole experts a rank where tp divides the expert count);
- with --other DIR, the same at tp 2 from another checkout (e.g. the commit before, which split every expert by
  its width: 768 / 2 = 384 cuts the down experts' 256-weight super-blocks);
- this checkout at tp 1 x 2 threads (the same cores, no split).
Each reports the batch-1 decode TPOT ((t(1 + O tokens) - t(1 token)) / O, a 32-token prompt), a 512-token prefill
and the device processes' summed RSS after them. Run under `flock /tmp/tandem-bench.lock`:
    python benchmarks/moe_tp.py [--layers 6] [--rounds 3] [--other DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(path: str, tp: int, threads: int, out: int) -> dict:
    """One engine's figures (run in a child process whose sys.path starts at the checkout under test)."""
    from tandem import LLM, SamplingParams                  # first: the checkout's (big_models puts HERE/.. first)
    from tandem.bench.datasets import random_requests

    from big_models import device_rss
    llm = LLM(path, tp_size=tp, device_threads=threads, max_model_len=2048)
    vocab = llm.engine.model_config.vocab_size

    def run(prompts, n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t
    try:
        short = [r.prompt for r in random_requests(1, 32, 1, vocab, seed=1)]
        run(short, 4)                                        # warm-up
        tpot = min((run(short, 1 + out) - run(short, 1)) / out for _ in range(2))
        prefill = min(run([r.prompt for r in random_requests(1, 512, 1, vocab, seed=2 + i)], 1)   # fresh: no cache
                      for i in range(2))
        return {"tpot_ms": 1e3 * tpot, "prefill_512_s": prefill, "device_rss_mb": device_rss().get("VmRSS", 0.0)}
    finally:
        llm.shutdown()


def child(repo: str, path: str, tp: int, threads: int, out: int) -> dict:
    code = (f"import sys; sys.path[:0] = [{repo!r}, {HERE!r}]; import json, moe_tp; "
            f"print('RESULT', json.dumps(moe_tp.measure({path!r}, {tp}, {threads}, {out})))")
    env = {**os.environ, "PYTHONPATH": repo}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=repo)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{repo} tp {tp} failed:\n{res.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6, help="layers of the Qwen3-30B-A3B-shaped file")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the engines (medians reported)")
    ap.add_argument("--out", type=int, default=32, help="decode tokens of the TPOT measurement")
    ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/tandem/models"),
                    help="where the synthetic GGUF file is written (once) and read")
    ap.add_argument("--other", default=None, help="another checkout to run at tp 2 beside this one")
    ap.add_argument("--json", default=None, help="write every round and the medians here")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    from tandem.model.gguf.synthetic import synthetic_file
    path = synthetic_file("qwen3-30b-a3b", args.models_dir, args.layers)
    repo = os.path.dirname(HERE)
    engines = {"tp 2, this checkout": (repo, 2, 1), "tp 1 x 2 threads": (repo, 1, 2)}
    if args.other:
        engines["tp 2, --other"] = (os.path.abspath(args.other), 2, 1)
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            checkout, tp, threads = engines[name]
            got = child(checkout, path, tp, threads, args.out)
            rounds[name].append(got)
            print(json.dumps({"round": r, "engine": name, **got}), flush=True)
    medians = {name: {k: statistics.median(g[k] for g in got) for k in got[0]} for name, got in rounds.items()}
    for name, m in medians.items():
        print(f"{name:22s} TPOT {m['tpot_ms']:7.2f} ms  prefill 512 {m['prefill_512_s']:6.2f} s  "
              f"device RSS {m['device_rss_mb']:7.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": os.path.basename(path), "layers": args.layers, "rounds": rounds, "medians": medians},
                      f, indent=1)


if __name__ == "__main__":
    main()
