"""What a pipeline stage boundary costs per micro-batch, measured, and a projection to 2 hosts (issue 20).

Measured here: two processes joined by gloo (as two pipeline stages are) pass the messages a boundary carries
per micro-batch of B decode rows (B = 1, 8, 64; SmolLM2-135M, hidden 576):
  - the hidden states and the deferred residual: two [B, 576] fp32 tensors (device/parallel/pp.py);
  - across nodes also the step's words ahead of them (one [6 + 2,048] int64 message: parallel/step_wire.py) and, from
    the last stage back to node 0, the sampled ids (a 5-word header and B words: parallel/pp_stage.py).
Each is timed as half a ping-pong (send then receive the same shapes back), the median of --iters.

The projection: a 2-host x 32-core pipeline of PP 2 (one stage a host) against one 32-core host, from the
per-micro-batch boundary cost above plus a network's, with the assumptions printed beside it (the forward
time per micro-batch at 32 cores is an input: --forward-ms, one figure per batch size, e.g. from
benchmarks/pp.py's PP 1 decode tok/s scaled by cores; nothing here measures a 32-core machine).
    python benchmarks/pp_messages.py [--iters 200] [--json benchmarks/results/pp_messages.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 576
STEP_WORDS = 6 + 2048


def messages(b: int, nodes: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors one micro-batch of b rows sends across a boundary (and back, across nodes)."""
    out = [((b, HIDDEN), torch.float32), ((b, HIDDEN), torch.float32)]
    if nodes:
        out = [((STEP_WORDS,), torch.int64)] + out + [((5,), torch.int64), ((b,), torch.int64)]
    return out


def _rank(rank: int, store: str, batches: list[int], iters: int, q) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    peer = 1 - rank
    res = {}
    for nodes in (False, True):
        for b in batches:
            ts = [torch.zeros(shape, dtype=dt) for shape, dt in messages(b, nodes)]
            times = []
            for i in range(iters + 10):
                dist.barrier()
                t = time.perf_counter()
                for x in ts:                            # there and back: rank 0 sends first
                    (dist.send if rank == 0 else dist.recv)(x, peer)
                for x in ts:
                    (dist.recv if rank == 0 else dist.send)(x, peer)
                if i >= 10:
                    times.append((time.perf_counter() - t) / 2)
            res[(nodes, b)] = statistics.median(times)
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200, help="ping-pongs per message set (median)")
    ap.add_argument("--batches", default="1,8,64", help="micro-batch rows, comma-separated")
    ap.add_argument("--net-latency-us", type=float, default=30.0,
                    help="assumed one-way latency of one message between the 2 hosts (TCP over 25 GbE)")
    ap.add_argument("--net-gbit", type=float, default=25.0, help="assumed link speed between the hosts, Gbit/s")
    ap.add_argument("--forward-ms", default="1.0,1.5,15.0",
                    help="assumed whole-model forward ms of one micro-batch at each batch size on one 32-core "
                         "host (defaults: batch 1 and 8 read the ~90 MB of weights at ~100 GB/s; batch 64 is "
                         "this 2-core machine's ~233 ms step scaled by 16)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    forward = dict(zip(batches, (float(x) for x in args.forward_ms.split(","))))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_rank, args=(r, store, batches, args.iters, q)) for r in (0, 1)]
        for p in procs:
            p.start()
        res = q.get(timeout=600)
        for p in procs:
            p.join()
    out = {"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
           "assumptions": {"net_latency_us": args.net_latency_us, "net_gbit": args.net_gbit,
                           "forward_ms_32_cores": forward,
                           "model": "PP 2 over 2 hosts: each host runs half the layers on its 32 cores; a "
                                    "micro-batch's time per stage is forward/2 plus, once, the boundary messages "
                                    "(loopback cost measured here + latency + bytes/bandwidth each); with 2 "
                                    "micro-batches in flight the pipeline's step is the slower stage"},
           "batches": {}}
    for b in batches:
        msgs = messages(b, True)
        nbytes = sum(torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for s, dt in msgs)
        net_s = len(msgs) * args.net_latency_us * 1e-6 + nbytes * 8 / (args.net_gbit * 1e9)
        loop_one, loop_nodes = res[(False, b)], res[(True, b)]
        f = forward.get(b, 0.0) * 1e-3
        stage = f / 2 + loop_nodes + net_s      # a stage's share of a micro-batch, boundary included
        # One host runs the whole forward for each micro-batch; PP 2 finishes a micro-batch per stage time.
        out["batches"][b] = {"loopback_boundary_us": round(1e6 * loop_one, 1),
                             "loopback_boundary_nodes_us": round(1e6 * loop_nodes, 1),
                             "bytes_per_micro_batch": nbytes, "net_us": round(1e6 * net_s, 1),
                             "projected_stage_ms": round(1e3 * stage, 3),
                             "projected_speedup_vs_one_host": round(f / stage, 3) if f else None,
                             "projected_bubble_share": round((loop_nodes + net_s) / stage, 3) if stage else None}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
