"""The prefix cache's disk tier (--kv-disk-dir, memory/disk_tier.py), ratios measured in one run:

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/disk_tier.py [--model FILE] [--tokens 4000]
        [--rounds 2] [--json benchmarks/results/disk_tier.json]

ttft: a --tokens prompt's TTFT (one output token) cold, from RAM (a prefix-cache hit), from disk after RAM evicted
  it (reset_prefix_cache), and from disk after a restart (a new engine on the same folder); the page cache is
  dropped before each disk read where this process may (/proc/sys/vm/drop_caches; the JSON says whether it could).
decode: 16 requests (--decode-prompt tokens of their own -> 128 tokens) with the tier on (writing each prompt's and
  each finished request's chunks) against the tier off, alternating in rounds: output tokens/s and the ratio.
Steal (the 8th field of /proc/stat's cpu line, ticks during the run) is printed beside each figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time


def _steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _landed(llm, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while llm.stats().get("disk_pending", 0) and time.monotonic() < end:
        time.sleep(0.05)


def _ttft(llm, ids: list[int]) -> tuple[float, int, list[int]]:
    from tandem import SamplingParams
    s0, t0 = _steal(), time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t0, _steal() - s0, out.num_cached_tokens, out.outputs[0].token_ids


def ttft(args, folder: str) -> dict:
    from tandem import LLM
    kw = dict(model=args.model, kv_disk_dir=folder, kv_cache_tokens=args.tokens + 512,
              max_model_len=args.tokens + 64, max_running_requests=16)
    rng = random.Random(0)
    llm = LLM(**kw)
    llm.generate([[rng.randrange(100, 30000) for _ in range(64)]], use_tqdm=False)      # warm-up
    rows = []
    for r in range(args.rounds):
        ids = [rng.randrange(100, 30000) for _ in range(args.tokens)]
        cold = _ttft(llm, ids)
        ram = _ttft(llm, ids)
        _landed(llm)
        llm.engine.scheduler.memory.reset_prefix_cache()
        dropped = _drop_page_cache()
        disk = _ttft(llm, ids)
        assert disk[3] == cold[3], "the disk tier changed the first token"
        rows.append({"round": r, "cold_s": cold[0], "ram_s": ram[0], "disk_s": disk[0], "disk_cached": disk[2],
                     "steal": [cold[1], ram[1], disk[1]], "page_cache_dropped": dropped,
                     "disk_over_cold": disk[0] / cold[0]})
        print(f"round {r}: cold {cold[0]:.3f} s, RAM hit {ram[0]:.3f} s, disk {disk[0]:.3f} s "
              f"({disk[2]} cached, {disk[0] / cold[0]:.3f}x cold), page cache dropped: {dropped}, "
              f"steal {cold[1]}/{ram[1]}/{disk[1]}")
    last = ids
    llm.shutdown()
    again = LLM(**kw)
    dropped = _drop_page_cache()
    restart = _ttft(again, last)
    print(f"restart: {restart[0]:.3f} s ({restart[2]} cached, {restart[0] / rows[-1]['cold_s']:.3f}x the cold "
          f"round), page cache dropped: {dropped}, steal {restart[1]}")
    stats = {k: v for k, v in again.stats().items() if k.startswith("disk_")}
    again.shutdown()
    return {"rounds": rows, "restart_s": restart[0], "restart_cached": restart[2],
            "restart_over_cold": restart[0] / rows[-1]["cold_s"], "stats_after_restart": stats}


def decode(args, folder: str) -> dict:
    from tandem import LLM, SamplingParams
    rng = random.Random(1)
    engines = {"off": LLM(model=args.model, kv_cache_tokens=16384),
               "on": LLM(model=args.model, kv_cache_tokens=16384, kv_disk_dir=folder)}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rows = []
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            prompts = [[rng.randrange(100, 30000) for _ in range(args.decode_prompt)] for _ in range(16)]
            s0, t0 = _steal(), time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"round": r, "tier": name, "seconds": dt, "tok_s": n / dt, "steal": _steal() - s0})
            print(f"round {r} tier {name}: {n / dt:.1f} tok/s ({dt:.2f} s), steal {rows[-1]['steal']}")
    for llm in engines.values():
        llm.shutdown()
    on = [x["tok_s"] for x in rows if x["tier"] == "on"]
    off = [x["tok_s"] for x in rows if x["tier"] == "off"]
    ratio = max(on) / max(off)
    print(f"tier on / off, best rounds: {ratio:.3f}x")
    return {"rounds": rows, "on_over_off": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=4000, help="the long prompt's tokens")
    p.add_argument("--decode-prompt", type=int, default=512, help="each decode request's own prompt tokens")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each measurement")
    p.add_argument("--dir", default=None, help="the tier's folder (default: a temporary one, removed after)")
    p.add_argument("--skip-decode", action="store_true", help="only the TTFT part")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="tandem-kv-disk-")
    try:
        out = {"model": os.path.basename(args.model) if args.model else "SmolLM2-135M-Instruct (default)",
               "tokens": args.tokens, "ttft": ttft(args, os.path.join(folder, "ttft"))}
        if not args.skip_decode:
            out["decode"] = decode(args, os.path.join(folder, "decode"))
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
