"""The q8_0 KV cache against bf16 (the default) at a long context, in one run: the KV bytes a context of --context
tokens holds, the device process's RSS once it is held, and decode TPOT at that context on the same file.

TPOT: one prompt of --context tokens is prefilled once (its time reported as the prefill), then the same prompt
again (a prefix-cache hit: only its last token runs) for 1 token and for 1 + G tokens; (t(1 + G) - t(1)) / G,
the median of 3. Default file: the 1.5B-shaped Q4_K_M (tandem's GGUF writer, llama.cpp's type mix).

    python benchmarks/kv_q8_long_context.py --json benchmarks/results/kv_q8_long_context.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from big_models import device_rss  # noqa: E402  (benchmarks/ is this script's folder)


def kv_bytes_per_token(path: str, kv: str) -> int:
    """Bytes a token's K and V take over every layer in a cache of `kv`."""
    import torch
    from tandem.kernels.kv_quant import Q8_0
    from tandem.model.kv_cache import kv_row_bytes
    from tandem.model.loader import resolve_model
    c = resolve_model(path).config
    dtype = Q8_0 if kv == "q8_0" else getattr(torch, kv)
    return 2 * c.num_layers * c.num_kv_heads * kv_row_bytes(dtype, c.head_dim)


def run_one(path: str, kv: str, context: int, gen: int, threads: int) -> dict:
    from tandem.llm import LLM
    from tandem.sampling_params import SamplingParams
    slots = context + gen + 64
    llm = LLM(model=path, max_model_len=slots, kv_cache_tokens=slots, device_threads=threads, kv_cache_dtype=kv)
    try:
        def run(ids, n):
            t = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t
        prompt = [1 + (7 * i + 13) % 30000 for i in range(context)]
        prefill = run(prompt, 1)
        tpots = []
        for _ in range(3):
            one, many = run(prompt, 1), run(prompt, 1 + gen)
            tpots.append((many - one) / gen)
        rss = device_rss()
    finally:
        llm.shutdown()
    per_token = kv_bytes_per_token(path, kv)
    return {"kv_cache_dtype": kv, "kv_bytes_per_token": per_token, "kv_mb_at_context": per_token * context / 1e6,
            "prefill_s": prefill, "tpot_ms": 1e3 * sorted(tpots)[1], "tpots_ms": [1e3 * t for t in tpots],
            "device_rss_mb": rss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the synthetic 1.5B-shaped Q4_K_M)")
    p.add_argument("--context", type=int, default=8192, help="prompt tokens: the context decode runs at")
    p.add_argument("--gen", type=int, default=32, help="tokens of a TPOT measurement")
    p.add_argument("--threads", type=int, default=2, help="device threads")
    p.add_argument("--kv", default="bfloat16,q8_0", help="KV cache dtypes, comma-separated (the first is the base)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    from tandem.bench import machine_info
    from tandem.model.gguf.synthetic import synthetic_file
    path = args.model or synthetic_file("qwen2.5-1.5b", os.path.expanduser("~/.cache/tandem/models"))
    rows = [run_one(path, kv, args.context, args.gen, args.threads) for kv in args.kv.split(",")]
    base = rows[0]
    for r in rows:
        r["kv_bytes_vs_base"] = r["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        r["tpot_vs_base"] = r["tpot_ms"] / base["tpot_ms"]
        print(f"{r['kv_cache_dtype']:>9}: KV {r['kv_mb_at_context']:.1f} MB at {args.context} tokens "
              f"({r['kv_bytes_vs_base']:.3f}x), TPOT {r['tpot_ms']:.1f} ms ({r['tpot_vs_base']:.3f}x), "
              f"prefill {r['prefill_s']:.1f} s, RSS {r['device_rss_mb'].get('VmRSS', 0):.0f} MB")
    out = {"model": os.path.basename(path), "context": args.context, "gen": args.gen,
           "machine": machine_info(args.threads), "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
