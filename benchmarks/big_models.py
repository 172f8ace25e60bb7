"""Models of the size users run: tandem against llama.cpp's own `llama-bench` on 1.5B-, 3B- and 8B-shaped Q4_K_M
files (tandem's GGUF writer, random weights, llama.cpp's type mix; both engines read the same file), in one run.

Per file: decode TPOT (single stream: (t(1 + G tokens) - t(1 token)) / G, prompt of 32 tokens; llama-bench tg
at an empty context), prefill tokens/s of a 512-token prompt (llama-bench pp512), the device process's RSS
(anonymous and file-backed) right after the prefills and once idle, and the bandwidth bound: bytes a decode step reads (the file's
matrices as blocks, KV at the context) over the best read bandwidth measured with the engine's threads before,
between and after the two engines' runs of the file; TPOT is reported as a ratio to that bound and to llama-bench.
The paired ratio ("xbound paired") takes each TPOT round against the bandwidth probed right before and after it
(the better of the two) and reports the median round: this machine's bandwidth drifts by up to 30 % within
minutes, and a bound from another minute than its TPOT's misstates the ratio either way.
An MoE shape's bound counts the active bytes: of its experts only the chosen top-k (roofline.decode_bytes_per_token).
Where a machine's memory speed moves between regimes that last minutes, `--starts N` runs N starts of tandem, each
followed by a llama-bench run (pairs in the same minutes), and reports the median start of each engine.

    python benchmarks/big_models.py --shapes qwen2.5-1.5b,llama-3.2-3b,llama-3.1-8b \
        --json benchmarks/results/big_models.json
    python benchmarks/big_models.py --shapes qwen3-30b-a3b --layers 6 --starts 3 \
        --json benchmarks/results/moe_a3b.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_rss() -> dict:
    """RSS of this process's children (the device process), in MB by kind."""
    me, out = os.getpid(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(("VmRSS", "RssAnon", "RssFile", "VmHWM")):
                        key, val = line.split(":")
                        out[key] = out.get(key, 0) + int(val.split()[0]) / 1024
        except (OSError, ValueError, IndexError):
            continue
    return out


def tandem_run(path: str, threads: int, gen: int, prompt: int, probe=None, rounds: int = 3, **engine) -> dict:
    """probe(): the read bandwidth now, measured before and after each TPOT round (rounds[i] = (bandwidth before,
    TPOT s, bandwidth after)), so that a round's bound sees the machine its TPOT saw."""
    from tandem.device.heap import IDLE_TRIM_S
    from tandem.llm import LLM
    from tandem.sampling_params import SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=path, max_model_len=2048, device_threads=threads, **engine)
    load_s = time.perf_counter() - t0
    try:
        def run(ids, n):
            sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate([ids], sp, use_tqdm=False)
            return time.perf_counter() - t
        short = [1 + i % 1000 for i in range(32)]
        run(short, 4)
        tpots, paired = [], []
        for _ in range(rounds):
            before = probe() if probe else None
            one, many = run(short, 1), run(short, 1 + gen)
            tpots.append((many - one) / gen)
            if probe:
                paired.append((before, tpots[-1], probe()))
        # a new prompt each time: a repeated one would be a prefix-cache hit, not a prefill
        longs = [[1 + (7 * i + 13 * r) % 30000 for i in range(prompt)] for r in range(3)]
        run(longs[0], 1)
        pp = min(run(p, 1) for p in longs[1:])
        busy = device_rss()
        time.sleep(IDLE_TRIM_S + 1)          # idle: the device gives its freed activations back (device/heap.py)
        rss = device_rss()
    finally:
        llm.shutdown()
    tpot = sorted(tpots)[len(tpots) // 2]
    return {"load_s": load_s, "tpot_ms": 1e3 * tpot, "rounds": paired, "decode_tokens_per_s": 1 / tpot,
            "prefill_tokens_per_s": prompt / pp, "device_rss_mb": rss, "device_rss_busy_mb": busy}


def measure_shape(shape: str, args, bin_dir: str | None, bw: float) -> tuple[dict, float]:
    """One file's row: `args.starts` starts of tandem, each followed by a llama-bench run, the read bandwidth
    around each; TPOTs as the median start (memory speed can move between regimes that last minutes: on an AMD
    EPYC the same file decoded 8.3 or 12.7 ms a token, llama-bench 11.05 or 12.8)."""
    from tandem.bench.llamacpp_tools import llama_bench
    from tandem.bench.roofline import decode_bytes_per_token, read_bandwidth
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.synthetic import synthetic_file
    path = synthetic_file(shape, args.models_dir, args.layers)
    mc = read_gguf_config(GGUFFile(path))
    step = decode_bytes_per_token(path, mc, context=32 + args.gen // 2)
    # the read bandwidth around each engine's run: on shared hosts it moves (31 or 48 GB/s on one EPYC), and
    # the bound takes the best seen, so that a slow phase never flatters a ratio
    bws, starts, llama = [bw], [], []
    for _ in range(args.starts):
        starts.append(tandem_run(path, args.threads, args.gen, args.prompt, read_bandwidth, args.rounds,
                                 batch_invariant=not args.no_batch_invariant))
        bws.append(read_bandwidth())
        if bin_dir:
            run = llama_bench(bin_dir, path, args.threads, args.prompt, 64, 3)
            bws.append(read_bandwidth())
            llama.append((run, max(bws[-2:])))        # with the better of the probes right before and after it
    starts.sort(key=lambda t: t["tpot_ms"])
    row = {"shape": shape, "layers": mc.num_layers, "file_bytes": os.path.getsize(path), "bytes_per_token": step,
           "tandem": starts[len(starts) // 2], "tandem_tpot_ms_starts": [t["tpot_ms"] for t in starts],
           "read_bandwidth_gb_s": [b / 1e9 for b in bws]}
    bound_ms = row["bound_tpot_ms"] = 1e3 * step["total"] / max(bws)
    if bin_dir:
        llama.sort(key=lambda r: -r[0]["tg64"]["tokens_per_s"])
        lb, lb_bw = llama[len(llama) // 2]
        row["llama_bench"] = lb
        row["llama_bench_tg64_ms_starts"] = [1e3 / r["tg64"]["tokens_per_s"] for r, _ in llama]
        row["tpot_vs_llama_bench"] = lb["tg64"]["tokens_per_s"] / row["tandem"]["decode_tokens_per_s"]
        row["prefill_vs_llama_bench"] = row["tandem"]["prefill_tokens_per_s"] / lb[f"pp{args.prompt}"]["tokens_per_s"]
        llama_tpot_s = 1 / lb["tg64"]["tokens_per_s"]
        row["llama_bench_tpot_vs_bound"] = 1e3 * llama_tpot_s / bound_ms
        # against the bandwidth probed right before and after that run, as tandem's rounds below
        row["llama_bench_tpot_vs_paired_bound"] = llama_tpot_s / (step["total"] / lb_bw)
    row["tpot_vs_bound"] = row["tandem"]["tpot_ms"] / bound_ms
    # each round against the bandwidth probed right around it (the better of the two): the bandwidth drifts
    # by up to 30 % within minutes here, so a bound from another minute than its TPOT's misstates the ratio
    paired = sorted(t / (step["total"] / max(b0, b1)) for b0, t, b1 in row["tandem"]["rounds"])
    row["tpot_vs_paired_bound"] = paired[len(paired) // 2]
    row["tpot_vs_paired_bound_rounds"] = paired
    return row, bws[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen2.5-1.5b,llama-3.2-3b,llama-3.1-8b", help="comma-separated SHAPES keys")
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/tandem/models"),
                   help="where the synthetic GGUF files are written (once) and read")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument("--layers", type=int, default=None,
                   help="layers of each file (default: the shape's), each of the real shape (e.g. 6 of qwen3-30b-a3b)")
    p.add_argument("--gen", type=int, default=32, help="decode tokens timed per TPOT measurement")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    p.add_argument("--rounds", type=int, default=5, help="TPOT rounds, each between two read-bandwidth probes")
    p.add_argument("--starts", type=int, default=1,
                   help="starts of tandem per file, each followed by a llama-bench run; TPOTs as the median start")
    p.add_argument("--skip-llamacpp", action="store_true", help="tandem only")
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="tandem with batch_invariant off (long prefill chunks take the faster, size-dependent paths)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    import torch

    from tandem.bench import machine_info
    from tandem.bench.llamacpp_tools import build_tools
    from tandem.bench.roofline import read_bandwidth

    torch.set_num_threads(args.threads)
    bin_dir = None if args.skip_llamacpp else build_tools()
    rows, bw = [], read_bandwidth()
    for shape in args.shapes.split(","):
        row, bw = measure_shape(shape, args, bin_dir, bw)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    out = {"threads": args.threads, "batch_invariant": not args.no_batch_invariant, "rows": rows,
           "machine": machine_info(args.threads)}
    print(f"read bandwidth ({args.threads} threads, the best around each file's runs): "
          + ", ".join(f"{max(r['read_bandwidth_gb_s']):.1f}" for r in rows) + " GB/s")
    print(f"{'shape':14s} {'file MB':>8s} {'TPOT ms':>8s} {'bound':>6s} {'xbound':>6s} {'x llama':>7s} "
          f"{'llama xbound':>12s} {'prefill x':>9s} {'RSS MB':>7s} {'xbound paired':>13s} {'llama paired':>12s}")
    for r in rows:
        t = r["tandem"]
        print(f"{r['shape']:14s} {r['file_bytes'] / 1e6:8.0f} {t['tpot_ms']:8.1f} {r['bound_tpot_ms']:6.1f} "
              f"{r['tpot_vs_bound']:6.2f} {r.get('tpot_vs_llama_bench', float('nan')):7.2f} "
              f"{r.get('llama_bench_tpot_vs_bound', float('nan')):12.2f} {r.get('prefill_vs_llama_bench', float('nan')):9.2f} "
              f"{t['device_rss_mb'].get('VmRSS', 0):7.0f} {r['tpot_vs_paired_bound']:13.2f} "
              f"{r.get('llama_bench_tpot_vs_paired_bound', float('nan')):12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
