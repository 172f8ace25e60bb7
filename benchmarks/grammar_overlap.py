"""How much overlap survives the grammar branch: tokens/s and device idle for 0 %, 50 % and 100 % of a batch
under a JSON schema, serial vs overlap, in one run (interleaved rounds on one engine).

    .venv/bin/python benchmarks/grammar_overlap.py [--threads 1] [--rounds 2] \
        [--json benchmarks/results/grammar_overlap.json]

Host-heavy config (as in benchmarks/overlap.py): a small random Llama whose step costs about what the
scheduler's host work costs, one device thread; here with the full SmolLM2 vocabulary (llguidance's
tokenizer view needs it), so the LM head and the race over 49,152 tokens are most of a step: one layer of
width 64 keeps them near the host's mask work (~0.15 ms a grammar row a step). Under the overlap loop grammar
rows make the device wait for their masks before sampling. The bound printed is the serial run's
(host + device) / max(host, device) per step: what a perfect overlap would give.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overlap import run_once  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 12},
    "score": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["name", "tags", "score"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tandem import LLM, SamplingParams
    from tests.helpers.tiny_models import make_tiny_model
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(args.requests)]
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(os.path.join(tmp, "hostheavy"), "llama", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        llm = LLM(model, device_threads=args.threads, kv_cache_tokens=32768)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, structured_outputs={"json": SCHEMA}),
                     use_tqdm=False)                                  # warm: tokenizer view, compile cache
        for share in (0.0, 0.5, 1.0):
            k = int(share * len(prompts))
            params = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                                     structured_outputs={"json": SCHEMA} if i < k else None,
                                     ignore_eos=i >= k) for i in range(len(prompts))]
            runs = {"serial": [], "overlap": []}
            for _ in range(args.rounds):
                for loop in ("serial", "overlap"):
                    runs[loop].append(run_once(llm, loop, prompts, params))
            res = {loop: {key: statistics.mean(r[key] for r in rs) for key in rs[0] if key != "loop"}
                   for loop, rs in runs.items()}
            s, o = res["serial"], res["overlap"]
            res["overlap_over_serial"] = o["tokens_per_s"] / s["tokens_per_s"]
            h, d = s["host_ms_per_step"], s["device_ms_per_step"]
            res["bound"] = (h + d) / max(h, d)
            report[f"grammar={share:.0%}"] = res
            print(f"grammar {share:>4.0%}: serial {s['tokens_per_s']:.0f} tok/s idle {s['device_idle_fraction']:.1%} | "
                  f"overlap {o['tokens_per_s']:.0f} tok/s idle {o['device_idle_fraction']:.1%} | "
                  f"overlap/serial {res['overlap_over_serial']:.2f} (bound {res['bound']:.2f}) | host {s['host_ms_per_step']:.2f} ms "
                  f"device {s['device_ms_per_step']:.2f} ms a step (serial)", flush=True)
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
