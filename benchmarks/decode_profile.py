"""Where a batch-1 decode step's time goes (issue 17's profile table): per op family, Python + dispatch, and the
host side (scheduler, IPC) around the device step, at 128 and 2,000 tokens of context.

Two runs per context, each one request of `--out` greedy tokens on the default model:
- plain: TPOT from the scheduler's side (t(1 + O) - t(1)) / O and the device span of each decode step (from
  the trace), so host + IPC = TPOT - device span;
- profiled: torch.profiler inside the device process (TANDEM_DEVICE_PROFILE, tandem/device/profile.py)
  gives each op family's share of the device step; "Python + dispatch" is the device step outside every op's
  own time (the profiler's own cost included: an upper bound); the plain step minus the profiled ops' time
  is a lower bound (the profiler slows the ops too).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/decode_profile.py [--threads 2] [--tag NAME]
writes benchmarks/results/decode_profile_NAME.{json,md} (NAME default: "now").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

FAMILIES = [  # (family, predicate on the op name), first match wins
    ("fused layer op's own time", lambda n: "decode_layer" in n),    # its calls are profiled by their op names
    ("quantized linears", lambda n: n.startswith(("tandem::linear_rows", "tandem::gemm_rows", "tandem::gemv_"))
     or n in ("aten::mm", "aten::addmm", "aten::linear")),
    ("gated delta rule (linear-attention layers)", lambda n: "gated_delta_rule" in n),
    ("experts (route + expert GEMVs)", lambda n: n.startswith("tandem::moe_")),
    ("decode attention", lambda n: "attention" in n),
    ("norms", lambda n: "rms_norm" in n),
    ("rope", lambda n: "rope" in n),
    ("silu x up", lambda n: "silu" in n),
    ("sampling", lambda n: n.startswith("tandem::race") or n.startswith("tandem::argmax")
     or n in ("aten::topk", "aten::argmax", "aten::log_softmax", "aten::_log_softmax")),
    ("embedding", lambda n: "embedding" in n or n.startswith("tandem::dequant")),
    ("indexing and copies", lambda n: any(k in n for k in ("index", "copy", "gather", "scatter", "cat", "select",
                                                              "slice", "view", "reshape", "as_strided", "to",
                                                              "contiguous", "empty", "zeros", "full", "arange",
                                                              "cumsum", "repeat_interleave", "nonzero"))),
]


def _family(name: str) -> str:
    return next((f for f, pred in FAMILIES if pred(name)), "other aten ops")


def _child(ctx: int, out: int, threads: int, profile_path: str | None, model: str | None = None) -> dict:
    """One engine in a fresh process (the profile env must reach its device process)."""
    env = dict(os.environ)
    if profile_path:
        env["TANDEM_DEVICE_PROFILE"] = profile_path
    code = f"""
import json, statistics, time
from tandem import LLM, SamplingParams
from tandem.bench.datasets import random_requests
llm = LLM({model!r}, device_threads={threads})
p = [random_requests(1, {ctx}, 1, llm.engine.model_config.vocab_size, seed={ctx})[0].prompt]
def run(n):
    t = time.perf_counter()
    llm.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t
run(8)
one, full = run(1), run(1 + {out})
spans = [d.end - d.start for d in list(llm.engine.recorder.devices)[-{out}:] if d.num_tokens == d.batch_size == 1]
print(json.dumps({{"tpot_ms": (full - one) / {out} * 1e3, "device_ms": statistics.median(spans) * 1e3}}))
llm.shutdown()
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(ctx: int, out: int, threads: int, model: str | None = None) -> dict:
    plain = _child(ctx, out, threads, None, model)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "profile.json")
        _child(ctx, out, threads, path, model)
        with open(path) as f:
            prof = json.load(f)
    assert prof["other_steps_while_profiling"] == 0, "a prefill step ran under the profiler"
    fam: dict[str, float] = {}
    for op in prof["ops"]:
        fam[_family(op["name"])] = fam.get(_family(op["name"]), 0.0) + op["self_ms_per_step"]
    wall = prof["wall_ms_per_step"]
    shares = {k: v / wall for k, v in sorted(fam.items(), key=lambda kv: -kv[1])}
    shares["Python + dispatch (+ profiler)"] = prof["other_ms_per_step"] / wall
    return {"context": ctx, **plain, "host_ipc_ms": plain["tpot_ms"] - plain["device_ms"],
            "profiled_step_ms": wall, "profiled_ops_ms": prof["ops_ms_per_step"], "shares_of_device_step": shares,
            "top_ops": prof["ops"][:12]}


def cpu_flags() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags")), "")
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
    have = set(line.split())
    model = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("Model name")), "")
    return f"{model}; " + " ".join(k for k in keep if k in have)


def render(res: list[dict], meta: dict) -> str:
    lines = [f"# Batch-1 decode step profile ({meta['tag']})", "",
             f"{meta.get('model') or 'Default model (SmolLM2-135M Q4_1 GGUF)'}, native kernels, {meta['threads']} device threads, "
             f"{meta['out']} greedy tokens; CPU: {meta['cpu']}. `benchmarks/decode_profile.py`.", "",
             "| | " + " | ".join(f"{r['context']} ctx" for r in res) + " |",
             "|---|" + "---|" * len(res),
             "| TPOT (scheduler side), ms | " + " | ".join(f"{r['tpot_ms']:.2f}" for r in res) + " |",
             "| device step (trace), ms | " + " | ".join(f"{r['device_ms']:.2f}" for r in res) + " |",
             "| host + IPC around it, ms | " + " | ".join(f"{r['host_ipc_ms']:.2f}" for r in res) + " |",
             "| device step under the profiler, ms | " + " | ".join(f"{r['profiled_step_ms']:.2f}" for r in res) + " |",
             "| device step outside ops (plain step - profiled op time), ms | "
             + " | ".join(f"{max(0.0, r['device_ms'] - r['profiled_ops_ms']):.2f}" for r in res) + " |"]
    fams = list(dict.fromkeys(k for r in res for k in r["shares_of_device_step"]))
    for f in fams:
        lines.append(f"| {f}, % of the device step | "
                     + " | ".join(f"{100 * r['shares_of_device_step'].get(f, 0.0):.1f}" for r in res) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="device threads")
    ap.add_argument("--out", type=int, default=64, help="output tokens per measured request")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2000], help="prompt lengths")
    ap.add_argument("--tag", default="now", help="name of the result files (e.g. start, end)")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: SmolLM2-135M Q4_1)")
    args = ap.parse_args()
    res = [measure(c, args.out, args.threads, args.model) for c in args.contexts]
    meta = {"tag": args.tag, "model": os.path.basename(args.model) if args.model else None, "threads": args.threads, "out": args.out, "cpu": cpu_flags(),
            "date": time.strftime("%Y-%m-%d")}
    save(f"decode_profile_{args.tag}", res, meta, render(res, meta))


def save(name: str, res: list[dict], meta: dict, text: str) -> None:
    """benchmarks/results/NAME.json (meta and results) and NAME.md (the rendered table), and print the table."""
    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
