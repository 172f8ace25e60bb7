"""Multi-turn chat on a hybrid (linear-attention) model: tandem's prefix cache, which keeps state checkpoints, against
llama.cpp's own `llama-server` (16 slots, cache_prompt on), on the same Qwen3.6-35B-A3B-shaped Q4_K_M file.

C conversations share one system prompt of S tokens; each turn adds U user tokens to the conversation's history and
answers A tokens; every conversation's turn is sent at once. The last turn is sent as a 1-token request, so its
wall time until each answer is that request's time to first token. Reported: the last turn's TTFT (median and max
over the conversations) of each engine and their ratio, each engine's prompt tokens served from its cache over the
whole run, and tandem's state checkpoints (saved, restored, memory a checkpoint). Engines run one after the other,
each on a cold start; the CPU steal of each run is printed beside it.

    .venv/bin/python benchmarks/hybrid_chat.py --llama-tools DIR --json benchmarks/results/hybrid_chat.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def conversations(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(1000, vocab - 1) for _ in range(args.system)]
    turns = [[[rng.randrange(1000, vocab - 1) for _ in range(args.user)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, turns


def run_chat(send, system, turns, answer: int, rewrite: int = 0) -> dict:
    """send(prompts, n) -> [(output ids, seconds until done)] for prompts sent at once. The last turn asks 1 token.
    rewrite: the history keeps each answer without its first `rewrite` tokens, as chat templates that drop an earlier
    turn's reasoning re-render it (the next prompt leaves the cached tokens where that answer starts)."""
    history = [list(system) for _ in turns]
    for t in range(len(turns[0])):
        last = t == len(turns[0]) - 1
        prompts = [h + conv[t] for h, conv in zip(history, turns)]
        outs = send(prompts, 1 if last else answer)
        history = [p + ids[rewrite:] for p, (ids, _) in zip(prompts, outs)]
    ttft = sorted(s for _, s in outs)
    return {"last_turn_ttft_s": ttft, "last_turn_ttft_median_s": statistics.median(ttft),
            "last_prompt_tokens": statistics.median(len(p) for p in prompts)}


def tandem_side(args, system, turns) -> dict:
    from tandem import LLM, SamplingParams
    from tandem.model.recurrent_state import state_bytes_per_row
    llm = LLM(args.model, max_running_requests=16, device_threads=args.threads, max_model_len=8192,
              hybrid_checkpoint_tokens=args.checkpoint_tokens)

    def send(prompts, n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t
        return [(o.token_ids, wall) for o in outs]      # one call: every answer is back at its end

    try:
        s0 = steal()
        row = run_chat(send, system, turns, args.answer, args.rewrite)
        st = llm.stats()
        c = llm.engine.model_config
        row.update(steal_ticks=steal() - s0, prefix_cache_hit_rate=st["prefix_cache_hits"] / st["prefix_cache_queries"],
                   state_checkpoints_saved=st.get("state_checkpoints_saved"),
                   state_checkpoints_restored=st.get("state_checkpoints_restored"),
                   state_mb_per_request=state_bytes_per_row(c, len(c.linear_layers)) / 1e6)
        return row
    finally:
        llm.shutdown()


def llama_side(args, system, turns) -> dict:
    from tandem.bench.llama_server import LlamaServerPeer
    peer = LlamaServerPeer(args.llama_tools, args.model, args.threads, 16, 8192)
    cached = [0, 0]

    def one(prompt, n):
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": True, "stream": False, "return_tokens": True}).encode()
        req = urllib.request.Request(peer.url + "/completion", body, {"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        done = time.perf_counter() - t
        cached[0] += len(prompt) - int(out.get("timings", {}).get("prompt_n", len(prompt)))
        cached[1] += len(prompt)
        return list(out.get("tokens") or []), done

    def send(prompts, n):
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: one(p, n), prompts))

    try:
        s0 = steal()
        row = run_chat(send, system, turns, args.answer, args.rewrite)
        row.update(steal_ticks=steal() - s0, prefix_cache_hit_rate=cached[0] / max(1, cached[1]))
        return row
    finally:
        peer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a hybrid GGUF (default: the synthetic qwen3.6-35b-a3b file)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the synthetic file (3 linear to 1 full)")
    ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/tandem/models"),
                    help="where the synthetic GGUF files are written (once) and read")
    ap.add_argument("--llama-tools", default=None, help="folder of llama-server (none: tandem alone)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine")
    ap.add_argument("--conversations", type=int, default=8, help="conversations at once")
    ap.add_argument("--turns", type=int, default=4, help="turns a conversation")
    ap.add_argument("--system", type=int, default=1000, help="system prompt tokens (shared)")
    ap.add_argument("--user", type=int, default=200, help="user tokens a turn")
    ap.add_argument("--answer", type=int, default=32, help="answer tokens a turn (the last turn: 1)")
    ap.add_argument("--checkpoint-tokens", type=int, default=0, help="tandem's hybrid_checkpoint_tokens")
    ap.add_argument("--rewrite", type=int, default=0,
                    help="drop each answer's first N tokens from the history (a template that strips reasoning)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from tandem.bench import machine_info
    from tandem.model.gguf.synthetic import synthetic_file
    args.model = args.model or synthetic_file("qwen3.6-35b-a3b", args.models_dir, args.layers)
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    system, turns = conversations(args, read_gguf_config(GGUFFile(args.model)).vocab_size)
    res = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k not in ("model", "models_dir",
                                                                                                "llama_tools")},
           "model": os.path.basename(args.model), "tandem": tandem_side(args, system, turns)}
    print("tandem", json.dumps(res["tandem"]))
    if args.llama_tools:
        res["llama_server"] = llama_side(args, system, turns)
        print("llama-server", json.dumps(res["llama_server"]))
        res["last_turn_ttft_vs_llama_server"] = (res["tandem"]["last_turn_ttft_median_s"]
                                                 / res["llama_server"]["last_turn_ttft_median_s"])
        print(f"last turn TTFT: tandem / llama-server = {res['last_turn_ttft_vs_llama_server']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
