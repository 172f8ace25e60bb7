"""tandem (default config, overlap loop) against llama.cpp batched (64 sequences in one llama_batch, the same GGUF)
on 64 x 32 -> 128, greedy, interleaved rounds alternating which goes first: issue 22's "vs llama.cpp batched
at 64 >= 2x". Needs llama-cpp-python in the venv (see docs/performance.md).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/batch_vs_llamacpp.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import random
import statistics

from tandem import LLM
from tandem.bench.engines import LlamaCppPeer, TandemPeer
from tandem.model.loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median taken)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine")
    args = ap.parse_args()
    rows, prompt_len, out = 64, 32, 128
    llm = LLM(device_threads=args.threads)
    vocab = llm.engine.model_config.vocab_size
    peers = {"tandem": TandemPeer(llm, "overlap"),
             "llama.cpp": LlamaCppPeer(default_model_path(), args.threads, rows, rows * (prompt_len + out))}
    res: dict[str, list[float]] = {name: [] for name in peers}
    for r in range(args.rounds):
        rng = random.Random(r)
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(rows)]
        for name in (list(peers) if r % 2 == 0 else list(peers)[::-1]):
            res[name].append(rows * out / peers[name].run(prompts, out))
            print(f"round {r} {name}: {res[name][-1]:.1f} output tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"median: tandem {med['tandem']:.1f}, llama.cpp {med['llama.cpp']:.1f} output tok/s; "
          f"tandem / llama.cpp = {med['tandem'] / med['llama.cpp']:.2f}x")
    peers["llama.cpp"].close()
    llm.shutdown()


if __name__ == "__main__":
    main()
