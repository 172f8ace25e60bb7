"""Tensor parallelism at equal cores: TP 2 x 1 thread against TP 1 x 2 threads, in one run (issue 13).

The model: SmolLM2-135M's shape (hidden 576, MLP 1536, 30 layers, vocab 49152, tied embeddings) with 8
attention heads and 4 KV heads (head_dim 72) so that the heads split over 2 ranks; random weights, written
as a Q4_1 GGUF like the default model, so both engines run the native quantized kernels. Both engines stay
loaded and the rounds alternate between them; each figure is the median of its rounds.
- decode tok/s at batch B: B prompts of 32 tokens, (t(B x (1 + O)) - t(B x 1)) / (B x O), so prefill is
  subtracted out;
- per decode step: device time and the time rank 0 spent in collectives (all-reduces, the logits gather,
  the step broadcast; DeviceSpan.comm in the trace), from the recorder of the last round;
- TP 2 twice: its forward's collectives over shared memory (the default on one host) and over gloo;
- one all-reduce alone (2 processes x 1 thread, the decode step's [B, 576] fp32 at B = 1 and 64), over gloo
  and over shared memory, the per-call cost the projection in benchmarks/results/tp.md starts from; and with
  both processes on one core, the shared-memory waiters' policy (bounded spin, then yield) against spinning.
Run under `flock /tmp/tandem-bench.lock`:
    python benchmarks/tp.py [--rounds 3] [--out 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.datasets import random_requests  # noqa: E402
from tandem.trace.recorder import stage_summary  # noqa: E402

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=2048)


def build_model(folder: str) -> str:
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    path = os.path.join(folder, "llama-135m-8h-q4_1.gguf")
    if not os.path.exists(path):
        hf = make_tiny_model(os.path.join(folder, "hf"), "llama", **SHAPE)
        write_tiny_gguf(path + ".tmp", hf, quant="Q4_1")
        os.replace(path + ".tmp", path)
    return path


def run_s(llm, prompts, out: int) -> float:
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def decode(llm, batch: int, out: int) -> dict:
    prompts = [r.prompt for r in random_requests(batch, 32, 1, llm.engine.model_config.vocab_size, seed=batch)]
    first = run_s(llm, prompts, 1)
    rec = llm.engine.recorder
    rec.clear()
    total = run_s(llm, prompts, 1 + out)
    steps = [d for d in rec.devices if not d.is_prefill]
    return {"tok_s": batch * out / (total - first),
            "step_ms": 1e3 * statistics.mean(d.end - d.start for d in steps),
            "comm_ms": 1e3 * statistics.mean(d.comm for d in steps),
            "stages": stage_summary(steps)}          # pipeline stages' own spans over the decode steps (PP)


def allreduce_us(rows: int, one_core: bool = False, policy: str = "default", iters: int = 300) -> dict:
    """Median microseconds of one all-reduce of [rows, 576] fp32 between two 1-thread processes, over gloo
    and over shared memory (device/parallel/shm_collectives.py); one_core pins both processes to CPU 0 (ranks sharing a
    core), policy "spin" makes the shared-memory waiters spin without yielding (to measure WaitPolicy)."""
    store = tempfile.mktemp(prefix="tandem-tp-bench-")
    procs = [subprocess.Popen([sys.executable, __file__, "--allreduce-worker", str(r), store, str(rows), str(iters),
                               str(int(one_core)), policy], stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if os.path.exists(store):
        os.unlink(store)
    return json.loads(out[0].strip().splitlines()[-1])


def allreduce_worker(rank: int, store: str, rows: int, iters: int, one_core: bool, policy: str) -> None:
    import dataclasses
    import datetime

    import torch
    import torch.distributed as dist

    from tandem.device.parallel.shm_collectives import ShmComm, WaitPolicy
    torch.set_num_threads(1)
    if one_core:
        os.sched_setaffinity(0, {0})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    shm = ShmComm.join(rank, 2, True, WaitPolicy(spins=10**9) if policy == "spin" else WaitPolicy())
    x, out = torch.randn(rows, 576), {}
    for name, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
        times = []
        for i in range(iters + 20):
            y = x.clone()
            t = time.perf_counter()
            reduce(y)
            if i >= 20:
                times.append(time.perf_counter() - t)
        out[f"{name}_us"] = 1e6 * statistics.median(times)
    out["shm_waits"] = dataclasses.asdict(shm.stats)
    shm.close()
    dist.destroy_process_group()
    print(json.dumps(out))


def cpu_flags() -> list[str]:
    """lscpu's SIMD flags (avx*, amx*): what the native kernels can use on this machine."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("Flags:")), "")
    return sorted(f for f in line.split()[1:] if f.startswith(("avx", "amx")))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--allreduce-worker":
        return allreduce_worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                                bool(int(sys.argv[6])), sys.argv[7])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per engine")
    ap.add_argument("--out", type=int, default=64, help="decode tokens per request")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tandem-bench-tp"),
                    help="where the random-weight model is built once")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    model = build_model(args.model_dir)
    load_start = open("/proc/loadavg").read().split()[:3]
    kw = dict(kv_cache_tokens=16384, max_running_requests=64)
    engines = {"tp1x2": LLM(model, tp_size=1, device_threads=2, **kw),
               "tp2x1": LLM(model, tp_size=2, device_threads=1, **kw),           # shared memory (one host)
               "tp2x1_gloo": LLM(model, tp_size=2, device_threads=1, tp_comm="gloo", **kw)}
    batches = [int(b) for b in args.batches.split(",")]
    rounds: dict = {(n, b): [] for n in engines for b in batches}
    try:
        for name, llm in engines.items():      # warm-up: page in weights and the KV buffers
            decode(llm, max(batches), 8)
        for _ in range(args.rounds):
            for b in batches:
                for name, llm in engines.items():
                    rounds[(name, b)].append(decode(llm, b, args.out))
    finally:
        for llm in engines.values():
            llm.shutdown()
    result = {"model": "llama 576 hidden, 30 layers, 8 heads / 4 KV heads, Q4_1 (random weights)",
              "cpu": subprocess.run(["sh", "-c", "lscpu | grep -E 'Model name|^CPU\\(s\\)'"], capture_output=True,
                                    text=True).stdout.split("\n"),
              "cpu_flags": cpu_flags(),
              "rounds": args.rounds, "out": args.out, "figures": {}}
    for (name, b), rs in rounds.items():
        result["figures"][f"{name}_b{b}"] = {k: statistics.median(r[k] for r in rs) for k in rs[0]} | \
            {"tok_s_rounds": [round(r["tok_s"], 1) for r in rs], "tok_s_best": max(r["tok_s"] for r in rs)}
    result["allreduce_us"] = {f"b{b}": allreduce_us(b) for b in batches}
    big = max(batches)
    result["allreduce_us"][f"b{big}_one_core"] = allreduce_us(big, one_core=True)
    result["allreduce_us"][f"b{big}_one_core_spin_only"] = allreduce_us(big, one_core=True, policy="spin", iters=100)
    for b in batches:
        f = result["figures"]
        result["figures"][f"ratio_b{b}"] = f[f"tp2x1_b{b}"]["tok_s"] / f[f"tp1x2_b{b}"]["tok_s"]
        result["figures"][f"ratio_gloo_b{b}"] = f[f"tp2x1_gloo_b{b}"]["tok_s"] / f[f"tp1x2_b{b}"]["tok_s"]
        # Best rounds against best rounds: what a quiet machine gives when foreign load hits some rounds.
        result["figures"][f"ratio_best_b{b}"] = f[f"tp2x1_b{b}"]["tok_s_best"] / f[f"tp1x2_b{b}"]["tok_s_best"]
    result["load_avg"] = {"start": load_start, "end": open("/proc/loadavg").read().split()[:3]}   # 1, 5, 15 min
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
