"""Data parallelism at equal cores: `tandem serve --dp 2 --device-threads 1` against `--dp 1 --device-threads 2`,
64 concurrent streaming clients through the server (`tandem bench serve`), rounds alternating the order.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/dp.py [--rounds 3] [--num-prompts 128]

Writes benchmarks/results/dp.md (a hand-measured section, linked from docs/parallelism.md) and
the JSON of each run under benchmarks/results/dp/.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
from datetime import date

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from run_all import free_port, shown_paths, tandem, wait_health  # noqa: E402

CONFIGS = {"DP 1 x 2 threads": ["--dp", "1", "--device-threads", "2"],
           "DP 2 x 1 thread": ["--dp", "2", "--device-threads", "1"]}
FIELDS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms", "failed")


def measure(name: str, engine: list[str], args, out_json: str, commands: list[str]) -> dict:
    """Start the server, wait for /health, run one `bench serve`, stop the server (SIGTERM); the run's JSON."""
    port = free_port()
    serve = tandem("serve", "--port", str(port), "--log-level", "warning", *engine, *args.engine_args)
    bench = tandem("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--max-concurrency",
                   str(args.concurrency), "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--vocab-size", "49152", "--json", out_json)
    for cmd in (serve, bench):               # as recorded: any port, any round
        shown = shown_paths("tandem " + shlex.join(cmd[3:])).replace(str(port), "PORT")
        shown = shown.replace(os.path.basename(out_json), os.path.basename(out_json).rsplit("_r", 1)[0] + "_rN.json")
        if shown not in commands:
            commands.append(shown)
    print(f"\n== {name}", flush=True)
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_health(f"http://127.0.0.1:{port}", proc)
        subprocess.run(bench, check=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    with open(out_json) as f:
        return json.load(f)


def lscpu_flags() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags:")), "")
    return " ".join(f for f in line.split() if f.startswith(("avx512f", "amx")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs both configurations, order alternating")
    ap.add_argument("--num-prompts", type=int, default=128, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=64, help="clients in flight")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids)")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    ap.add_argument("engine_args", nargs="*", help="more `tandem serve` flags (after --)")
    args = ap.parse_args()
    raw = os.path.join(args.out, "dp")
    os.makedirs(raw, exist_ok=True)
    commands: list[str] = []
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            tag = name.split(" x ")[0].replace(" ", "").lower()
            runs[name].append(measure(name, CONFIGS[name], args, os.path.join(raw, f"{tag}_r{r}.json"), commands))
    write_md(args, runs, commands)
    return 0


def write_md(args, runs: dict[str, list[dict]], commands: list[str]) -> None:
    dp1, dp2 = (runs[n] for n in CONFIGS)
    ratios = [b["output_throughput"] / a["output_throughput"] for a, b in zip(dp1, dp2)]
    lines = ["## Data parallelism at equal cores (`benchmarks/dp.py`, issue 13)", "",
             f"Measured on {date.today().isoformat()} under `flock /tmp/tandem-bench.lock`, on a "
             f"{os.cpu_count()}-core {__import__('tandem.bench', fromlist=['cpu_model']).cpu_model()} "
             f"(`lscpu`: {lscpu_flags()}), shared with other engineers' work, so only ratios within a round are "
             f"compared. {dp1[0]['model_id']} (the default model), {args.num_prompts} requests x "
             f"{args.input_len} random prompt ids -> {args.output_len} tokens (ignore_eos, greedy, streamed), "
             f"{args.concurrency} clients in flight; each run starts a fresh server, rounds alternate the order. "
             f"`--dp 2` pins each replica (engine and device process) to one core; the frontend is unpinned.", "",
             "```", "flock /tmp/tandem-bench.lock .venv/bin/python " + shlex.join(["benchmarks/dp.py", *sys.argv[1:]]),
             "# which runs, for each configuration and round:", *commands, "```", "",
             "| round | configuration | output tok/s | median TTFT ms | median TPOT ms | p99 ITL ms | failed |",
             "|---|---|---|---|---|---|---|"]
    for r in range(len(dp1)):
        for name in CONFIGS:
            d = runs[name][r]
            lines.append(f"| {r + 1} | {name} | {d['output_throughput']:.1f} | {d['median_ttft_ms']:.0f} | "
                         f"{d['median_tpot_ms']:.1f} | {d['p99_itl_ms']:.0f} | {d['failed']} |")
    lines += ["", f"DP 2 / DP 1 output throughput, per round: {', '.join(f'{x:.2f}x' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f}x; goal >= 1.0x).", ""]
    with open(os.path.join(args.out, "dp.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
