"""The paged decode attention op alone at SmolLM2-135M's shapes (9 query heads over 3 KV heads, head_dim 64,
30 layers), batch 1, one call timed and multiplied by 30 (one decode step's attention). Run each build in its
own process (`--lib` loads a given tandem_kernels-*.so, e.g. an older build, instead of this checkout's):

    flock /tmp/tandem-bench.lock python benchmarks/decode_attention.py --threads 1 2 --contexts 128 2048
"""
import argparse
import json
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--lib", default=None, help="a built tandem_kernels-*.so (default: build/load this checkout's)")
p.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
p.add_argument("--batch", type=int, default=1)
p.add_argument("--iters", type=int, default=200)
p.add_argument("--isa", type=int, default=-1)
p.add_argument("--chunk-keys", type=int, default=None, help="the op's chunk_keys (0: never split); default: "
               "not passed (builds before it have no such argument)")
p.add_argument("--cpu-time", action="store_true", help="this thread's CPU time, not wall time (one thread only: "
               "robust to a loaded machine)")
args = p.parse_args()
if args.lib:
    torch.ops.load_library(args.lib)
else:
    from tandem import kernels
    assert kernels.available(), kernels.unavailable_reason()

H, KVH, D, LAYERS = 9, 3, 64, 30
extra = [args.isa] + ([] if args.chunk_keys is None else [args.chunk_keys])
clock = time.thread_time if args.cpu_time else time.perf_counter
assert not args.cpu_time or args.threads == [1], "--cpu-time measures one thread"
out = {}
for ctx in args.contexts:
    slots = args.batch * ctx
    cache = torch.randn(slots + 1, LAYERS, 2, KVH, D)           # [S + 1, L, 2, KVH, D], every layer's K/V a slot
    kv_index = torch.arange(slots).view(args.batch, ctx)        # consecutive slots, as a fresh request gets
    seq_lens = torch.full((args.batch,), ctx)
    q = torch.randn(args.batch, H, D)
    for t in args.threads:
        torch.set_num_threads(t)
        for _ in range(20):
            torch.ops.tandem.decode_attention(q, cache, 7, kv_index, seq_lens, D ** -0.5, *extra)
        best = float("inf")
        for _ in range(5):                                      # best of 5 runs of iters calls, layers cycled
            t0 = clock()
            for i in range(args.iters):
                torch.ops.tandem.decode_attention(q, cache, i % LAYERS, kv_index, seq_lens, D ** -0.5, *extra)
            best = min(best, (clock() - t0) / args.iters)
        out[f"ctx{ctx}_t{t}"] = round(best * LAYERS * 1e3, 3)   # ms for 30 layers
print(json.dumps(out))
