"""Where a batched decode step's time goes (issue 22's profile tables): per op family, for a batch-64 decode step
(64 x 32 -> 128, the vLLM decode workload) and for a decode step of 32 rows sharing a cached 900-token prefix
(32 x (900 + 24) -> 32, the shared-prefix workload; the prefix is served once first so the radix cache holds it).

Each workload runs in a fresh process with torch.profiler inside the device process (TANDEM_DEVICE_PROFILE,
tandem/device/profile.py) over the decode steps after the first 8; the families are decode_profile.py's.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/batch_profile.py [--tag start|end] [--kernels-act int8]
writes benchmarks/results/batch_profile_TAG.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import _family, cpu_flags, save  # noqa: E402
from tandem.bench import isa_caps  # noqa: E402

WORKLOADS = {  # name: (rows, prompt tokens of each row, shared prefix tokens, output tokens)
    "decode 64 x 32 -> 128": (64, 32, 0, 128),
    "shared prefix 32 x (900 + 24) -> 32": (32, 24, 900, 32),
}


def _child(rows: int, prompt: int, prefix: int, out: int, threads: int, kernels_act: str, path: str,
           engine: dict) -> dict:
    env = dict(os.environ, TANDEM_DEVICE_PROFILE=path)
    code = f"""
import json, random, time
from tandem import LLM, SamplingParams
llm = LLM(device_threads={threads}, kernels_act={kernels_act!r}, **{engine!r})
vocab = llm.engine.model_config.vocab_size
rng = random.Random(0)
prefix = [rng.randrange(100, vocab) for _ in range({prefix})]
prompts = [prefix + [rng.randrange(100, vocab) for _ in range({prompt})] for _ in range({rows})]
sp = SamplingParams(temperature=0, max_tokens={out}, ignore_eos=True)
if prefix:
    llm.generate([prefix + [7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
t = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
wall = time.perf_counter() - t
steps = [d for d in llm.engine.recorder.devices if d.num_tokens == d.batch_size == {rows}]
dev = sorted(d.end - d.start for d in steps)
print(json.dumps({{"wall_s": wall, "tok_s": {rows} * {out} / wall, "device_ms": dev[len(dev) // 2] * 1e3 if dev else None}}))
llm.shutdown()
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(name: str, threads: int, kernels_act: str, engine: dict) -> dict:
    rows, prompt, prefix, out = WORKLOADS[name]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "profile.json")
        plain = _child(rows, prompt, prefix, out, threads, kernels_act, path, engine)
        with open(path) as f:
            prof = json.load(f)
    fam: dict[str, float] = {}
    for op in prof["ops"]:
        fam[_family(op["name"])] = fam.get(_family(op["name"]), 0.0) + op["self_ms_per_step"]
    wall = prof["wall_ms_per_step"]
    return {"workload": name, **plain, "profiled_steps": prof["steps"], "batch_sizes": prof["batch_sizes"],
            "other_steps_while_profiling": prof["other_steps_while_profiling"], "profiled_step_ms": wall,
            "ms_per_family": dict(sorted(fam.items(), key=lambda kv: -kv[1])),
            "python_dispatch_ms": prof["other_ms_per_step"], "top_ops": prof["ops"][:12]}


def render(res: list[dict], meta: dict) -> str:
    lines = [f"# Batched decode step profile ({meta['tag']})", "",
             f"Default model (SmolLM2-135M Q4_1 GGUF), kernels_act={meta['kernels_act']}, engine options "
             f"{meta.get('engine') or 'default'}, {meta['threads']} device "
             f"threads, greedy; CPU: {meta['cpu']}. `benchmarks/batch_profile.py`. Times are per decode step under "
             "torch.profiler (which slows every op a little); the untraced throughput is the whole run's.", "",
             "| | " + " | ".join(r["workload"] for r in res) + " |", "|---|" + "---|" * len(res),
             "| whole run under the profiler, tok/s | " + " | ".join(f"{r['tok_s']:.1f}" for r in res) + " |",
             "| decode step under the profiler, ms | " + " | ".join(f"{r['profiled_step_ms']:.1f}" for r in res) + " |",
             "| other steps inside the profiled window | "
             + " | ".join(str(r["other_steps_while_profiling"]) for r in res) + " |"]
    fams = list(dict.fromkeys(k for r in res for k in r["ms_per_family"]))
    for f in fams:
        lines.append(f"| {f}, ms (%) | " + " | ".join(
            f"{r['ms_per_family'].get(f, 0.0):.1f} ({100 * r['ms_per_family'].get(f, 0.0) / r['profiled_step_ms']:.0f} %)"
            for r in res) + " |")
    lines.append("| Python + dispatch (+ profiler), ms | " + " | ".join(f"{r['python_dispatch_ms']:.1f}" for r in res) + " |")
    lines += ["", "Top ops (self time per step, ms):", ""]
    for r in res:
        lines.append(f"- {r['workload']}: " + ", ".join(f"`{o['name']}` {o['self_ms_per_step']:.1f}"
                                                      for o in r["top_ops"][:8]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="device threads")
    ap.add_argument("--tag", default="now", help="name of the result files (e.g. start, end)")
    ap.add_argument("--kernels-act", default="int8", help="int8 (the default) or fp32 (the exact mode)")
    ap.add_argument("--engine", type=json.loads, default={},
                    help='other engine options as JSON, e.g. \'{"kv_cache_dtype": "float32"}\'')
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS),
                    help="which workloads to profile (default: both)")
    args = ap.parse_args()
    res = [measure(w, args.threads, args.kernels_act, args.engine) for w in args.workloads]
    meta = {"tag": args.tag, "threads": args.threads, "kernels_act": args.kernels_act, "engine": args.engine,
            "cpu": cpu_flags() + "".join(f"; {k}={v}" for k, v in isa_caps().items()),
            "date": time.strftime("%Y-%m-%d")}
    save(f"batch_profile_{args.tag}", res, meta, render(res, meta))


if __name__ == "__main__":
    main()
