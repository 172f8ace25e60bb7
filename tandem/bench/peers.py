"""`tandem bench peers`: the same prompts and output lengths through tandem and its peers, in one run.

Engines (greedy, ignore_eos, same thread count; tandem and transformers in fp32, llama.cpp on the GGUF's own
quantized weights): tandem overlap, tandem serial, transformers `generate` on static batches (the fastest of
--hf-batch-sizes in a short probe), transformers continuous batching, llama.cpp's own C++ `llama-server` with one
slot and with the fastest of --llama-batch-sizes parallel slots (built once from the llama-cpp-python sdist's
source, tandem/bench/llamacpp_tools.py: the engine its users run, --llama-tools), llama.cpp's Python binding
single stream and batched where it is installed (it adds Python work per token) and, where installed
(--vllm-python), vLLM's CPU build through its OpenAI server
(fp32, on a Hugging Face folder of the same weights; the install is in tandem/bench/vllm_peer.py). Rounds
alternate the engines' order, because this machine drifts between rounds; the table gives each engine's median
output tokens/s, its ratio to tandem overlap, and its single-stream TPOT = (time for O tokens - time for 1
token) / (O - 1) of one request.
`--tpot-contexts 128,2000` (the default) adds single-stream TPOT at those prompt lengths for tandem overlap and
llama.cpp single, rounds alternating the two, medians. `--concurrency 1,8,32` adds a sweep: every engine at
batch (running-request cap) c on max(4, c) prompts (the prompt count `bench serve --max-concurrency c` is
given in benchmarks/run_all.py).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

from . import engine_threads, machine_info
from .datasets import random_requests
from .engines import (HFContinuousPeer, HFGeneratePeer, LlamaCppPeer, Peer, TandemPeer, hf_continuous_reason,
                      llama_cpp_reason, load_hf_model)
from .llama_server import LlamaServerPeer
from .llamacpp_tools import tools_for
from .vllm_peer import VllmPeer, VllmServer, export_hf_folder, vllm_reason

ENGINES = ("tandem overlap", "tandem serial", "transformers generate", "transformers generate_batch",
           "llama-server single", "llama-server batched", "llama.cpp single", "llama.cpp batched", "vllm cpu")
SWEEP_ENGINES = ("tandem overlap", "tandem serial", "transformers generate", "transformers generate_batch",
                 "llama-server", "llama.cpp", "vllm cpu")
PROBED = ("transformers generate", "llama-server batched", "llama.cpp batched")   # the fastest batch size runs
Factory = Callable[[int | None], Peer]


def sweep_prompts(concurrency: int) -> int:
    return max(4, concurrency)


def tokens_per_s(peer: Peer, prompts: list[list[int]], output_len: int) -> float:
    return len(prompts) * output_len / peer.run(prompts, output_len)


def single_stream_tpot_ms(peer: Peer, prompt: list[int], output_len: int) -> float | None:
    if output_len < 2:
        return None
    one = peer.run([prompt], 1)
    return 1e3 * max(0.0, peer.run([prompt], output_len) - one) / (output_len - 1)


def probe(make: Factory, sizes: list[int], prompts: list[list[int]], probe_len: int) -> tuple[Peer, dict]:
    """The fastest batch size on one batch of `probe_len` tokens per prompt; the others are closed.
    A size that fails (e.g. past an engine's sequence limit) is recorded as its error and skipped."""
    best, best_tps, seen = None, -1.0, {}
    for b in sizes:
        try:
            peer = make(b)
            peer.run(prompts[:min(2, b)], 2)                  # warm-up
            seen[b] = tokens_per_s(peer, prompts[:b], probe_len)
        except Exception as e:
            seen[b] = f"{type(e).__name__}: {e}"
            continue
        if seen[b] > best_tps:
            if best is not None:
                best.close()
            best, best_tps = peer, seen[b]
        else:
            peer.close()
    if best is None:
        raise RuntimeError(f"every batch size failed: {seen}")
    return best, seen


def make_factories(llm, model_path: str, threads: int, context_len: int, args=None,
                   servers: list | None = None) -> tuple[dict[str, Factory], dict]:
    """Peer factories by engine name (argument: the batch size or running cap), and why others are skipped.
    Servers started for a peer (vLLM) are appended to `servers`, for the caller to close."""
    made: dict[str, Factory] = {
        "tandem overlap": lambda b: TandemPeer(llm, "overlap", b),
        "tandem serial": lambda b: TandemPeer(llm, "serial", b),
    }
    skipped: dict[str, str] = {}
    try:
        hf = load_hf_model(model_path)
        made["transformers generate"] = lambda b: HFGeneratePeer(hf, b or 1)
        reason = hf_continuous_reason(hf)
        if reason:
            skipped["transformers generate_batch"] = reason
        else:
            made["transformers generate_batch"] = lambda b: HFContinuousPeer(hf, b)
    except Exception as e:                                       # e.g. a GGUF architecture transformers lacks
        skipped["transformers generate"] = skipped["transformers generate_batch"] = \
            f"transformers could not load the model: {type(e).__name__}: {e}"
    bin_dir, reason = tools_for(model_path, getattr(args, "llama_tools", "auto"))
    if reason:
        skipped["llama-server single"] = skipped["llama-server batched"] = reason
    else:
        log = getattr(args, "llama_server_log", None)
        made["llama-server single"] = lambda b: LlamaServerPeer(bin_dir, model_path, threads, 1, context_len, log)
        made["llama-server batched"] = lambda b: LlamaServerPeer(bin_dir, model_path, threads, b or 1, context_len,
                                                                 log)
    reason = llama_cpp_reason(model_path)
    if reason:
        skipped["llama.cpp single"] = skipped["llama.cpp batched"] = reason
    else:
        made["llama.cpp single"] = lambda b: LlamaCppPeer(model_path, threads, 1, context_len)
        made["llama.cpp batched"] = lambda b: LlamaCppPeer(model_path, threads, b or 1, context_len)
    python = getattr(args, "vllm_python", None)
    reason = vllm_reason(python)
    if reason:
        skipped["vllm cpu"] = reason
    else:
        try:
            server = VllmServer(python, export_hf_folder(model_path), threads, kv_gib=args.vllm_kv_gib,
                                max_num_seqs=llm.engine.config.max_running_requests,
                                max_model_len=context_len, log_path=args.vllm_log)
            print(f"starting vLLM ({' '.join(server.command())}); it compiles for about 2 minutes", flush=True)
            servers.append(server.start())
            made["vllm cpu"] = lambda b: VllmPeer(server, b)
        except Exception as e:
            skipped["vllm cpu"] = f"failed to start: {type(e).__name__}: {e}"
    return made, skipped


def build_peers(made: dict[str, Factory], skipped: dict, prompts, args) -> dict[str, Peer]:
    peers: dict[str, Peer] = {}
    probe_len = min(args.output_len, args.probe_len)
    for name in ENGINES:
        if name not in made:
            continue
        try:
            if name in PROBED:
                sizes = args.hf_batch_sizes if name.startswith("transformers") else args.llama_batch_sizes
                sizes = [b for b in sizes if b <= len(prompts)] or [len(prompts)]
                peer, seen = probe(made[name], sizes, prompts, probe_len)
                peer.probe = seen
            else:
                peer = made[name](None)
                peer.run(prompts[:2], 2)                             # warm-up
            if name in ("llama-server single", "llama.cpp single"):
                peer.max_prompts = args.single_prompts
            peers[name] = peer
        except Exception as e:
            skipped[name] = f"failed: {type(e).__name__}: {e}"
    return peers


def run_rounds(peers: dict[str, Peer], skipped: dict, prompts, output_len: int, rounds: int) -> dict:
    tps: dict[str, list[float]] = {name: [] for name in peers}
    order = list(peers)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            if name in skipped:
                continue
            peer = peers[name]
            try:
                tps[name].append(tokens_per_s(peer, prompts[:peer.max_prompts], output_len))
                print(f"round {r} {name:28s} {tps[name][-1]:9.1f} tok/s", flush=True)
            except Exception as e:
                skipped[name] = f"failed in round {r}: {type(e).__name__}: {e}"
    return tps


CONTEXT_ENGINES = ("tandem overlap", "llama-server single", "llama.cpp single")   # tandem over the first llama


def context_tpot(peers: dict[str, Peer], skipped: dict, vocab: int, args) -> dict:
    """Single-stream TPOT (ms) at each --tpot-contexts prompt length, per engine of CONTEXT_ENGINES."""
    names = [n for n in CONTEXT_ENGINES if n in peers and n not in skipped]
    runs: dict[str, dict[int, list[float]]] = {n: {c: [] for c in args.tpot_contexts} for n in names}
    errors: dict[str, str] = {}
    for c in args.tpot_contexts:
        prompt = random_requests(1, c, 1, vocab, 0.0, args.seed + c)[0].prompt
        for name in names:
            # Warm-up at this context: a first long prefill allocates buffers, and TPOT is a difference of two
            # runs that both prefill c tokens (unwarmed, the first round read 0 ms at 2,000 tokens).
            try:
                peers[name].run([prompt], 2)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                if name in errors:
                    continue
                try:
                    runs[name][c].append(single_stream_tpot_ms(peers[name], prompt, args.tpot_output_len))
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"
    med = {n: [statistics.median(runs[n][c]) if runs[n][c] and n not in errors else None
               for c in args.tpot_contexts] for n in names}
    ratio = None
    if len(names) >= 2 and names[0] == "tandem overlap" and names[1] not in errors:
        ratio = [a / b if a is not None and b else None for a, b in zip(med[names[0]], med[names[1]])]
    return {"contexts": args.tpot_contexts, "output_len": args.tpot_output_len, "tpot_ms": med,
            "rounds_ms": {n: {str(c): v for c, v in runs[n].items()} for n in names},
            "tandem_over_llama_cpp": ratio, "llama_cpp_engine": names[1] if ratio else None,
            "skipped": {**{n: skipped[n] for n in CONTEXT_ENGINES if n in skipped}, **errors}}


def sweep(made: dict[str, Factory], concurrency: list[int], vocab: int, args) -> dict:
    out = {"concurrency": concurrency, "prompts": [], "engines": {name: [] for name in SWEEP_ENGINES},
           "skipped": {}}
    for c in concurrency:
        n = sweep_prompts(c)
        prompts = [r.prompt for r in random_requests(n, args.input_len, args.output_len, vocab, 0.0, args.seed)]
        out["prompts"].append(n)
        for name in SWEEP_ENGINES:
            key = name if name not in ("llama-server", "llama.cpp") else f"{name} {'single' if c == 1 else 'batched'}"
            tps = None
            if key in made:
                peer = None
                try:
                    peer = made[key](c)
                    peer.run(prompts[:2], 2)
                    tps = tokens_per_s(peer, prompts, args.output_len)
                except Exception as e:
                    out["skipped"][f"{name}@{c}"] = f"{type(e).__name__}: {e}"
                finally:
                    if peer is not None and not key.startswith("tandem"):
                        peer.close()
            out["engines"][name].append(tps)
            print(f"concurrency {c:3d} {name:28s} {tps if tps is not None else float('nan'):9.1f} tok/s", flush=True)
    return out


def bench_peers(args) -> dict:
    import torch

    from ..cli import engine_config
    from ..llm import LLM
    from ..model.loader import default_model_path
    config = engine_config(args)
    threads = engine_threads(config)
    torch.set_num_threads(threads)                  # transformers runs here, with tandem's device thread count
    model_path = config.model or default_model_path()
    llm = LLM(**dataclasses.asdict(config))
    peers: dict[str, Peer] = {}
    servers: list = []
    try:
        vocab = llm.engine.model_config.vocab_size
        prompts = [r.prompt for r in random_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                                                     0.0, args.seed)]
        longest = max([args.input_len + args.output_len] + [c + args.tpot_output_len for c in args.tpot_contexts])
        made, skipped = make_factories(llm, model_path, threads, longest + 16, args, servers)
        peers = build_peers(made, skipped, prompts, args)
        tps = run_rounds(peers, skipped, prompts, args.output_len, args.rounds)
        tpot = {}
        for name, peer in peers.items():
            if name not in skipped:
                try:
                    tpot[name] = single_stream_tpot_ms(peer, prompts[0], args.output_len)
                except Exception as e:
                    skipped[name] = f"failed in the TPOT run: {type(e).__name__}: {e}"
        contexts = context_tpot(peers, skipped, vocab, args) if args.tpot_contexts else None
        swept = sweep(made, args.concurrency, vocab, args) if args.concurrency else None
        name = llm.engine.model_name
    finally:
        for peer in peers.values():
            peer.close()
        for server in servers:
            server.close()
        llm.shutdown()
    base = statistics.median(tps["tandem overlap"]) if tps.get("tandem overlap") else None
    results = []
    for engine in ENGINES:
        peer, runs = peers.get(engine), tps.get(engine) or []
        med = statistics.median(runs) if runs and engine not in skipped else None
        results.append({
            "engine": engine, "output_tokens_per_s": med, "rounds_tokens_per_s": runs,
            "ratio_to_tandem_overlap": med / base if med is not None and base else None,
            "tpot_ms": tpot.get(engine), "batch_size": (config.max_running_requests if engine.startswith("tandem")
                                                        else getattr(peer, "batch_size", None)),
            "prompts_timed": min(len(prompts), peer.max_prompts or len(prompts)) if peer else None,
            "probe_tokens_per_s": getattr(peer, "probe", None), "skipped": skipped.get(engine)})
    out = {"model": name, "model_path": model_path, "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "rounds": args.rounds, "seed": args.seed, "threads": threads,
           "results": results, "context_tpot": contexts, "sweep": swept, "engine_config": dataclasses.asdict(config),
           "machine": machine_info(threads)}
    print_table(out)
    return out


def print_table(out: dict) -> None:
    print(f"\n{out['model']}: {out['num_prompts']} prompts x {out['input_len']} in, {out['output_len']} out, "
          f"{out['threads']} threads, median of {out['rounds']} rounds")
    print(f"{'engine':30s} {'batch':>5s} {'out tok/s':>10s} {'vs overlap':>10s} {'TPOT@1 ms':>10s}")
    for r in out["results"]:
        if r["output_tokens_per_s"] is None:
            print(f"{r['engine']:30s} skipped: {r['skipped']}")
            continue
        ratio = f"{r['ratio_to_tandem_overlap']:.2f}x" if r["ratio_to_tandem_overlap"] is not None else "-"
        tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] is not None else "-"
        batch = str(r["batch_size"]) if r["batch_size"] else "-"
        print(f"{r['engine']:30s} {batch:>5s} {r['output_tokens_per_s']:10.1f} {ratio:>10s} {tpot:>10s}")
    c = out.get("context_tpot")
    if c:
        print(f"single-stream TPOT ms ({c['output_len']} tokens after a prompt of N):")
        for name, values in c["tpot_ms"].items():
            print(f"  {name:28s} " + "  ".join(f"N={n}: {v:.2f}" if v is not None else f"N={n}: -"
                                               for n, v in zip(c["contexts"], values)))
        if c["tandem_over_llama_cpp"]:
            ratios = zip(c["contexts"], c["tandem_over_llama_cpp"])
            print(f"  tandem / {c['llama_cpp_engine']:19s} "
                  + "  ".join(f"N={n}: {r:.2f}x" if r is not None else f"N={n}: -" for n, r in ratios))
