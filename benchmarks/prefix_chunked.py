"""Prefix cache and chunked prefill on the real default model (SmolLM2-135M), each figure a ratio measured
in one run (the machine drifts between runs):

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefix_chunked.py shared-prefix [--rounds 2]
    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefix_chunked.py itl [--mixed 32,64,128]
    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefix_chunked.py decode [--rounds 2]
    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefix_chunked.py behind [--rounds 3]

shared-prefix: 32 requests, one 900-token prefix + 24 own tokens -> 32 tokens, prefix cache on vs off
  (interleaved rounds; each round a fresh prefix, so the cached engine computes it once per round).
itl: 16 streams (32 in -> 160 out) are decoding when a 4000-token prompt arrives; inter-token latency of
  the streams (p50, p99, max) with mixed steps at each prefill share, and with the whole prompt in one
  step (enable_mixed_chunk off, max_prefill_tokens 8192), as before chunked prefill. One engine, the
  configurations switched between runs (the scheduler reads its config live), in interleaved rounds; also
  the median mixed step over the median decode-only step of each run, from the device spans.
decode: 64 x 32 -> 128 (the offline workload of benchmarks/results/run_all.md) with the cache and mixed steps on vs off.
behind: a 32-token request arrives just after a 4000-token prompt's first chunk is launched (idle engine,
  default config): its TTFT against one chunk step (the first step: the long prompt's first 2048 tokens, in
  flight when it arrives) plus its own prefill (its TTFT on an idle engine, same round).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _llm(**kw):
    from tandem import LLM
    return LLM(**kw)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49152) for _ in range(n)]


def _warm(llm) -> None:
    from tandem import SamplingParams
    llm.generate([_ids(random.Random(-1), 16)] * 2, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def shared_prefix(args) -> dict:
    from tandem import SamplingParams
    engines = {"cache on": _llm(), "cache off": _llm(prefix_cache=False)}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for llm in engines.values():
            _warm(llm)
        for r in range(args.rounds):
            rng = random.Random(r)
            prefix = _ids(rng, 900)
            prompts = [prefix + _ids(rng, 24) for _ in range(32)]
            for name, llm in engines.items():
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - t)
                print(f"round {r} {name}: {times[name][-1]:.2f} s, cached tokens "
                      f"{sum(o.num_cached_tokens for o in outs)}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    on, off = statistics.median(times["cache on"]), statistics.median(times["cache off"])
    return {"workload": "32 x (900 shared + 24) -> 32", "seconds": times, "speedup_cache_on": off / on}


def _itl_run(llm, rng: random.Random) -> dict:
    """16 streams decoding; at their 20th token a 4000-token prompt arrives. Gaps between stream tokens."""
    from tandem import SamplingParams
    eng = llm.engine
    stamps: dict[str, list[float]] = {}
    added: list[float] = []
    streams = [eng.make_request(_ids(rng, 32), SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
               for _ in range(16)]
    long = eng.make_request(_ids(rng, 4000), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def sink(outputs):
        t = time.perf_counter()
        for o in outputs:
            if o.new_token_ids:
                stamps.setdefault(o.rid, []).append(t)
        if not added and stamps and len(next(iter(stamps.values()))) >= 20:
            eng.add_request(long, bounded=False)
            added.append(t)

    old = eng._sink
    eng._sink = sink
    try:
        for r in streams:
            eng.add_request(r, bounded=False)
        eng.run()
    finally:
        eng._sink = old
    gaps = sorted(b - a for rid, ts in stamps.items() if rid != long.rid for a, b in zip(ts, ts[1:]))
    ttft_long = stamps[long.rid][0] - added[0]
    p = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))]       # noqa: E731
    return {"p50_ms": 1e3 * p(0.5), "p99_ms": 1e3 * p(0.99), "max_ms": 1e3 * gaps[-1],
            "p99_over_p50": p(0.99) / p(0.5), "long_ttft_s": ttft_long}


def itl(args) -> dict:
    configs = {f"mixed {m}": dict(enable_mixed_chunk=True, max_prefill_tokens=2048, mixed_prefill_tokens=m)
               for m in args.mixed}
    configs["one step (no chunking)"] = dict(enable_mixed_chunk=False, max_prefill_tokens=8192)
    out: dict[str, list[dict]] = {name: [] for name in configs}
    llm = _llm(prefix_cache=False)
    eng = llm.engine
    try:
        _warm(llm)
        for r in range(args.rounds):
            for name, kw in configs.items():
                eng.config = eng.config.replace(**kw)
                eng.recorder.clear()
                res = _itl_run(llm, random.Random(7 + r))
                devs = list(eng.recorder.devices)
                mixed = [d.end - d.start for d in devs if d.is_prefill and d.batch_size == 17]   # 16 decode rows + a chunk
                plain = [d.end - d.start for d in devs if not d.is_prefill]
                if mixed and plain:
                    res["mixed_step_over_decode_step"] = statistics.median(mixed) / statistics.median(plain)
                out[name].append(res)
                print(f"round {r} {name}", json.dumps({k: round(v, 2) for k, v in res.items()}), flush=True)
    finally:
        llm.shutdown()
    return out


def decode(args) -> dict:
    from tandem import SamplingParams
    rng = random.Random(0)
    prompts = [_ids(rng, 32) for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    engines = {"new defaults": _llm(), "cache and mixed off": _llm(prefix_cache=False, enable_mixed_chunk=False)}
    tps: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for llm in engines.values():
            _warm(llm)
        for r in range(args.rounds):
            for name, llm in engines.items():
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                tps[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
                print(f"round {r} {name}: {tps[name][-1]:.1f} output tok/s", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {"workload": "64 x 32 -> 128", "output_tok_s": tps,
            "ratio_new_over_off": statistics.median(tps["new defaults"]) /
            statistics.median(tps["cache and mixed off"])}


def _ttft(eng, short, long=None) -> tuple[float, list]:
    """TTFT of `short`; with `long`, `long` is queued first and `short` arrives right after the first step
    (the long prompt's first chunk) is launched. Also the device spans of the run."""
    stamps: dict[str, float] = {}
    added: list[float] = []
    import tandem.scheduler.loops as loops
    from tandem.scheduler.launch import launch_step

    def sink(outputs):
        t = time.perf_counter()
        for o in outputs:
            if o.new_token_ids:
                stamps.setdefault(o.rid, t)

    def launch(s, batch):
        handle = launch_step(s, batch)
        if not added:
            added.append(time.perf_counter())
            eng.add_request(short, bounded=False)
        return handle

    old = eng._sink
    eng._sink = sink
    eng.recorder.clear()
    try:
        if long is None:
            added.append(time.perf_counter())
            eng.add_request(short, bounded=False)
        else:
            loops.launch_step = launch              # the loops call loops.launch_step(s, batch)
            eng.add_request(long, bounded=False)
        eng.run()
    finally:
        eng._sink = old
        loops.launch_step = launch_step
    return stamps[short.rid] - added[0], list(eng.recorder.devices)


def behind(args) -> list[dict]:
    from tandem import SamplingParams
    llm = _llm()
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = []
    try:
        _warm(llm)
        for r in range(args.rounds):
            rng = random.Random(100 + r)            # fresh prompts: nothing served from the prefix cache
            alone, _ = _ttft(eng, eng.make_request(_ids(rng, 32), params))
            long = eng.make_request(_ids(rng, 4000), params)
            ttft, devs = _ttft(eng, eng.make_request(_ids(rng, 32), params), long)
            first = min(devs, key=lambda d: d.step)
            chunk = first.end - first.start         # the long prompt's first chunk, in flight at the arrival
            res = {"short_ttft_behind_s": ttft, "chunk_step_s": chunk, "short_alone_ttft_s": alone,
                   "ratio_to_chunk_plus_own": ttft / (chunk + alone),
                   "steps": [[d.batch_size, d.num_tokens, round(d.end - d.start, 3)] for d in devs[:4]]}
            out.append(res)
            print(f"round {r}", json.dumps(res), flush=True)
    finally:
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("shared-prefix", "itl", "decode", "behind"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mixed", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"shared-prefix": shared_prefix, "itl": itl, "decode": decode, "behind": behind}[args.what](args)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
