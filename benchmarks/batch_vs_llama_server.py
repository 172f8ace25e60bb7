"""Batch-64 decode on a 1.5B-shaped Q4_K_M file: tandem (overlap loop, 64 requests running together) against
llama.cpp's own `llama-server` with 16 parallel slots (continuous batching, 64 clients at once), the same GGUF,
64 x 32 -> 128 tokens, greedy, EOS ignored, interleaved rounds alternating which goes first. Output tok/s is
64 x 128 over the wall time of a round (prefill included for both).

    .venv/bin/python benchmarks/batch_vs_llama_server.py --json benchmarks/results/batch_vs_llama_server.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="a tandem.model.gguf.synthetic SHAPES key")
    ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/tandem/models"),
                    help="where the synthetic GGUF files are written (once) and read")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the file (default: the shape's), each of the real shape (e.g. 6 of qwen3-30b-a3b)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median taken)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine")
    ap.add_argument("--rows", type=int, default=64, help="requests sent together")
    ap.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens a request")
    ap.add_argument("--out", type=int, default=128, help="output tokens a request")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from tandem import LLM
    from tandem.bench import machine_info
    from tandem.bench.engines import TandemPeer
    from tandem.bench.llama_server import LlamaServerPeer
    from tandem.bench.llamacpp_tools import build_tools
    from tandem.model.gguf.synthetic import synthetic_file

    path = synthetic_file(args.shape, args.models_dir, args.layers)
    bin_dir = build_tools()
    llm = LLM(model=path, device_threads=args.threads, max_running_requests=args.rows,
              max_model_len=args.prompt + args.out + 16)
    server = LlamaServerPeer(bin_dir, path, args.threads, args.slots, args.prompt + args.out + 16)
    peers = {"tandem": TandemPeer(llm, "overlap", args.rows), "llama-server": server}
    vocab = llm.engine.model_config.vocab_size
    res: dict[str, list[float]] = {name: [] for name in peers}
    try:
        for r in range(args.rounds):
            rng = random.Random(r)
            prompts = [[rng.randrange(100, min(vocab, 30000)) for _ in range(args.prompt)] for _ in range(args.rows)]
            for name in (list(peers) if r % 2 == 0 else list(peers)[::-1]):
                res[name].append(args.rows * args.out / peers[name].run(prompts, args.out))
                print(f"round {r} {name}: {res[name][-1]:.1f} output tok/s", flush=True)
    finally:
        server.close()
        llm.shutdown()
    med = {k: statistics.median(v) for k, v in res.items()}
    ratio = med["tandem"] / med["llama-server"]
    print(f"median: tandem {med['tandem']:.1f}, llama-server {med['llama-server']:.1f} output tok/s; "
          f"tandem / llama-server = {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "layers": args.layers, "rows": args.rows, "slots": args.slots, "prompt": args.prompt,
                       "out": args.out, "threads": args.threads, "output_tok_s": res, "median": med,
                       "tandem_over_llama_server": ratio, "machine": machine_info(args.threads)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
