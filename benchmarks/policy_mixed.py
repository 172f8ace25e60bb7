"""The scheduling policies on `tandem bench serve --mixed` (issue 45): for each policy pair, one `tandem serve` per
policy in turn (default model, --max-running-requests as given so the flood queues), the same seeded mixed
workload at a rate that saturates it, and each class's p50 / p99 TTFT, output throughput and (the backlog mix, sent
at once) share of tokens while every tenant waits; plus the trickle's TTFT on an idle server (its requests one at a
time), the reference of the priority goal.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/policy_mixed.py --json results/policy_mixed.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# (workload, policy, extra serve flags): the priority policy also without urgent steps (a high-priority arrival
# then waits for the low-priority step in flight) and with a smaller prefill chunk beside decode rows (which bounds
# that wait); backlog always sent at once.
RUNS = (("priority", "fcfs", ()), ("priority", "priority", ()), ("priority", "priority", ("--no-urgent-steps",)),
        ("priority", "priority", ("--no-urgent-steps", "--mixed-prefill-tokens", "64")), ("tenants", "fcfs", ()),
        ("tenants", "fair", ()), ("backlog", "fcfs", ()), ("backlog", "fair", ()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(policy: str, running: int, port: int, extra: tuple = ()) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), "--log-level",
                             "warning", "--scheduling-policy", policy, "--max-running-requests", str(running),
                             *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def bench(port: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", "--json", out, *extra], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=120, help="requests of the mixed workload")
    ap.add_argument("--input-len", type=int, default=256, help="the flood's prompt tokens (the trickle: a quarter)")
    ap.add_argument("--output-len", type=int, default=64, help="the flood's output tokens (the trickle: a quarter)")
    ap.add_argument("--request-rate", default="inf", help="arrivals per s (inf: all at once, saturating)")
    ap.add_argument("--max-running", type=int, default=16, help="the server's --max-running-requests")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--workloads", default="priority,tenants,backlog", help="which mixes to run (comma-separated)")
    args = ap.parse_args()
    work = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--request-rate", args.request_rate, "--seed", "7"]
    summary: dict = {}
    port = free_port()
    proc = serve("fcfs", args.max_running, port)
    try:                                                   # the trickle's shape, one request at a time, idle
        idle = bench(port, ["--num-prompts", "16", "--input-len", str(args.input_len // 4), "--output-len",
                            str(args.output_len // 4), "--max-concurrency", "1", "--seed", "8"])
        summary["idle trickle"] = {"p50_ttft_ms": idle["median_ttft_ms"], "p99_ttft_ms": idle["p99_ttft_ms"]}
    finally:
        proc.terminate()
        proc.wait()
    print(json.dumps(summary), flush=True)
    for mix, policy, extra in RUNS:
        if mix not in args.workloads.split(","):
            continue
        port = free_port()
        proc = serve(policy, args.max_running, port, extra)
        try:
            rate = ["--request-rate", "inf"] if mix == "backlog" else []
            r = bench(port, [*work, *rate, "--mixed", mix])
        finally:
            proc.terminate()
            proc.wait()
        key = " ".join((mix, "/", policy, *extra))
        summary[key] = {"output_throughput": r["output_throughput"], "classes": r["classes"]}
        print(json.dumps({key: summary[key]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"json": None}, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
