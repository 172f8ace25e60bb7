"""Serial vs overlap, measured in one run: device idle fraction, tokens/s, and the overlap bound.

    .venv/bin/python benchmarks/overlap.py [--workloads smollm,hostheavy] [--threads 1,2] [--rounds 2]

(a) smollm: SmolLM2-135M, 64 requests x 128 tokens. (b) hostheavy: a small random Llama whose forward costs
about what the scheduler's host work per step costs. Loops run in interleaved rounds on one engine per
thread count (the machine drifts between rounds). The bound is (host + device) / max(host, device) per step,
from the serial run's own spans; forward slowdown compares decode forwards under overlap vs serial.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def steady_decode(devices) -> dict:
    """Idle between consecutive decode forwards, and their mean duration."""
    d = sorted(devices, key=lambda s: s.start)
    busy = gaps = 0.0
    fwd = []
    for a, b in zip(d, d[1:]):
        if not a.is_prefill and not b.is_prefill and a.batch_size == b.batch_size:
            gaps += max(0.0, b.start - a.end)
            busy += a.end - a.start
            fwd.append(a.end - a.start)
    return {"steady_idle_fraction": gaps / (gaps + busy) if busy else 0.0,
            "decode_forward_ms": 1e3 * statistics.mean(fwd) if fwd else 0.0,
            "wake_ms": 1e3 * statistics.mean([s.start - s.launch for s in d]) if d else 0.0}


def run_once(llm, loop: str, prompts, params) -> dict:
    eng = llm.engine
    eng.config = eng.config.replace(scheduler=loop)
    eng.recorder.clear()
    before = eng.output_tokens
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    out = eng.recorder.summary(wall_s=wall, output_tokens=eng.output_tokens - before)
    out.update(steady_decode(eng.recorder.devices))
    launches = [e - s for n, _, s, e in eng.recorder.host if n == "launch"]
    out["launch_ms"] = 1e3 * statistics.mean(launches) if launches else 0.0
    return out


def workload(name: str, tmp: str):
    from tandem import SamplingParams
    rng = random.Random(0)
    if name == "smollm":
        model, n, in_len, out_len = None, 64, 32, 128
    else:
        from tests.helpers.tiny_models import make_tiny_model
        # A small vocabulary keeps the LM head from dominating: the forward costs about the host's work.
        model = make_tiny_model(os.path.join(tmp, "hostheavy"), "llama", hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)
        n, in_len, out_len = 64, 32, 128
    vocab = 40000 if name == "smollm" else 2000
    prompts = [[rng.randrange(100, vocab) for _ in range(in_len)] for _ in range(n)]
    # Host work: the host-heavy case checks a stop string on every request (incremental detokenization).
    stop = ["@@never@@"] if name != "smollm" else None
    return model, prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, stop=stop)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="smollm,hostheavy")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tandem import LLM, SamplingParams
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            model, prompts, params = workload(name, tmp)
            for threads in [int(t) for t in args.threads.split(",")]:
                llm = LLM(model, device_threads=threads, kv_cache_tokens=32768)
                llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
                runs = {"serial": [], "overlap": []}
                for _ in range(args.rounds):
                    for loop in ("serial", "overlap"):
                        runs[loop].append(run_once(llm, loop, prompts, params))
                llm.shutdown()
                res = {loop: {k: statistics.mean(r[k] for r in rs) for k in rs[0] if k != "loop"}
                       for loop, rs in runs.items()}
                s, o = res["serial"], res["overlap"]
                h, d = s["host_ms_per_step"], s["device_ms_per_step"]
                bound = (h + d) / max(h, d)
                ratio = o["tokens_per_s"] / s["tokens_per_s"]
                res["bound"] = bound
                res["overlap_over_serial"] = ratio
                res["fraction_of_bound"] = ratio / bound
                res["forward_slowdown"] = o["decode_forward_ms"] / s["decode_forward_ms"] - 1
                report[f"{name}/threads={threads}"] = res
                print(f"{name} threads={threads}: serial {s['tokens_per_s']:.1f} tok/s idle "
                      f"{s['device_idle_fraction']:.1%} (steady {s['steady_idle_fraction']:.1%}) | overlap "
                      f"{o['tokens_per_s']:.1f} tok/s idle {o['device_idle_fraction']:.1%} (steady "
                      f"{o['steady_idle_fraction']:.1%}) | ratio {ratio:.3f} bound {bound:.3f} "
                      f"({ratio / bound:.1%}) | host {h:.2f} ms dev {d:.2f} ms/step | fwd slowdown "
                      f"{res['forward_slowdown']:+.1%} | launch {s['launch_ms']:.3f} ms wake {s['wake_ms']:.3f} ms",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
