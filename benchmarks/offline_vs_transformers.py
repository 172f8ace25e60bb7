"""Decode throughput: tandem (overlap and serial) next to transformers `generate`, same prompts, one run.

    .venv/bin/python benchmarks/offline_vs_transformers.py [--requests 64 --input-len 32 --output-len 128]

Prompts are seeded random token ids; every request generates exactly --output-len tokens (ignore_eos),
fp32 on CPU. transformers runs static batches of --hf-batch (left-padded) with greedy generate.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tandem import LLM, SamplingParams
    from tandem.model.loader import default_model_path

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    total = args.requests * args.output_len
    results = {}

    llm = LLM(device_threads=args.threads)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    for loop in ("overlap", "serial"):
        llm.engine.config = llm.engine.config.replace(scheduler=loop)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        assert sum(len(o.token_ids) for o in outs) == total
        results[f"tandem_{loop}"] = {"wall_s": dt, "output_tokens_per_s": total / dt}
        print(f"tandem {loop:8s} {total / dt:7.1f} tok/s  ({dt:.1f} s)", flush=True)
    llm.shutdown()

    from transformers import AutoModelForCausalLM
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            ids = torch.tensor(prompts[i:i + args.hf_batch])      # equal lengths: no padding needed
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t
    results["transformers_generate"] = {"wall_s": dt, "output_tokens_per_s": total / dt,
                                        "batch": args.hf_batch}
    print(f"transformers generate (batch {args.hf_batch}) {total / dt:7.1f} tok/s  ({dt:.1f} s)")
    ratio = results["tandem_overlap"]["output_tokens_per_s"] / results["transformers_generate"]["output_tokens_per_s"]
    results["ratio_tandem_overlap_vs_transformers"] = ratio
    print(f"tandem overlap / transformers = {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
