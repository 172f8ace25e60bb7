"""The disk tier on an agent workload whose working set is several times the RAM prefix cache (issue 68):

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/disk_tier_agents.py [--tenants 32] [--system-len 1000]
        [--ram-share 0.2] [--rounds 2] [--json benchmarks/results/disk_tier_agents.json]

`tandem bench serve --agents TENANTS`: each request its tenant's system prompt (the same every time) plus its own
tokens, tenants drawn at random. The servers' KV cache holds --ram-share of the working set (tenants x system
prompt), so RAM keeps evicting the prompts the next requests need. Each round starts one fresh server with the tier
off and one with it on (a new folder: it warms within the round), alternating which goes first; throughput, p50 /
p99 TTFT and the steal of each run are printed and the ratios taken from the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from policy_mixed import bench, free_port, serve


def _steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def run(args, tier: bool, folder: str) -> dict:
    kv = int(args.tenants * args.system_len * args.ram_share)
    extra = ["--kv-cache-tokens", str(kv), *(["--kv-disk-dir", folder] if tier else [])]
    port = free_port()
    proc = serve("fcfs", args.max_running, port, tuple(extra))
    try:
        s0 = _steal()
        r = bench(port, ["--agents", str(args.tenants), "--system-len", str(args.system_len), "--num-prompts",
                         str(args.requests), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                         "--max-concurrency", str(args.concurrency), "--seed", str(args.seed)])
        r["steal"] = _steal() - s0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    r["kv_cache_tokens"] = kv
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=32, help="agents' tenants, each with its own system prompt")
    ap.add_argument("--system-len", type=int, default=1000, help="tokens of each tenant's system prompt")
    ap.add_argument("--ram-share", type=float, default=0.2, help="the KV cache as a share of the working set")
    ap.add_argument("--requests", type=int, default=128, help="requests a run")
    ap.add_argument("--input-len", type=int, default=32, help="each request's own tokens after the system prompt")
    ap.add_argument("--output-len", type=int, default=16, help="tokens each request generates")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--max-running", type=int, default=16, help="the servers' --max-running-requests")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each a tier-off and a tier-on run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload (the same in every run)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {}
        for tier in order:
            folder = tempfile.mkdtemp(prefix="tandem-agents-")
            try:
                got[tier] = run(args, tier, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            m = got[tier]
            print(f"round {r} tier {'on ' if tier else 'off'}: {m['output_throughput']:.1f} out tok/s, "
                  f"{m['completed']} done in {m['duration']:.1f} s, TTFT p50 {m['median_ttft_ms']:.0f} ms "
                  f"p99 {m['p99_ttft_ms']:.0f} ms, steal {m['steal']}")
        on, off = got[True], got[False]
        rows.append({"round": r, "off": off, "on": on,
                     "throughput_on_over_off": on["output_throughput"] / off["output_throughput"],
                     "p99_ttft_on_over_off": on["p99_ttft_ms"] / off["p99_ttft_ms"],
                     "p50_ttft_on_over_off": on["median_ttft_ms"] / off["median_ttft_ms"]})
        print(f"round {r}: throughput on/off {rows[-1]['throughput_on_over_off']:.2f}x, p99 TTFT on/off "
              f"{rows[-1]['p99_ttft_on_over_off']:.3f}x, p50 {rows[-1]['p50_ttft_on_over_off']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"json": os.path.basename(args.json)}, "rounds": rows}, f, indent=1)


if __name__ == "__main__":
    main()
