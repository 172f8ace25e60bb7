"""benchmarks/RESULTS.md, today's headline against each peer, rendered from the JSON files under
benchmarks/results/; and, for benchmarks/run_all.py, its sweep page (results/run_all.md) and
throughput_vs_concurrency.png.

    python3 benchmarks/render_results.py        # rewrites benchmarks/RESULTS.md (standard library only)

Every figure of RESULTS.md is read from a JSON file that RUNS names. RUNS adds only what those files do not
record: the peer's version, the date and the CPU flags, each quoted from the run's note beside its JSON. A JSON
that is missing is an error, not a blank row: the headline never loses a figure silently.
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))

PENDING = "_Not measured yet: run `.venv/bin/python benchmarks/run_all.py`._"
PLOT = "throughput_vs_concurrency.png"


def load(res: str, name: str) -> dict | None:
    path = os.path.join(res, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(v, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def offline_section(off: dict) -> list[str]:
    if not any(off.values()):
        return [PENDING]
    rows = [[loop, str(r["successful_requests"]), fmt(r["duration_s"], ".2f"), fmt(r["request_throughput"], ".2f"),
             fmt(r["input_throughput"]), fmt(r["output_throughput"]), fmt(r["total_throughput"])]
            for loop, r in off.items() if r]
    any_r = next(r for r in off.values() if r)
    return [(f"{any_r['model']}: {any_r['num_prompts']} prompts x {any_r['input_len']} tokens in, "
             f"{any_r['output_len']} out (ignore_eos, greedy), fp32."), ""] + \
        table(["loop", "requests", "duration s", "req/s", "input tok/s", "output tok/s", "total tok/s"], rows)


def peers_section(p: dict | None) -> list[str]:
    if not p:
        return [PENDING]
    rows = []
    for r in p["results"]:
        note = r["skipped"] or (f"{r['prompts_timed']} prompts timed" if r["prompts_timed"] != p["num_prompts"]
                                else "")
        rows.append([r["engine"], str(r["batch_size"] or "–"), fmt(r["output_tokens_per_s"]),
                     fmt(r["ratio_to_tandem_overlap"], ".2f") + ("x" if r["ratio_to_tandem_overlap"] else ""),
                     fmt(r["tpot_ms"], ".2f"), " / ".join(fmt(v, ".0f") for v in r["rounds_tokens_per_s"]), note])
    where = p.get("machine", {}).get("cpu_model")
    return [(f"{p['model']}: {p['num_prompts']} prompts x {p['input_len']} in, {p['output_len']} out, "
             + (f"on {where} (this run's machine; the Machine section is run_all's), " if where else "")
             + f"{p['threads']} threads, median of {p['rounds']} alternating rounds. Batch: tandem's running-request "
             f"cap, the probed static batch of transformers generate and llama.cpp batched. TPOT@1: one request, "
             f"(t(O tokens) - t(1 token)) / (O - 1). llama.cpp runs the GGUF's own quantized weights."), ""] + \
        table(["engine", "batch", "output tok/s", "vs tandem overlap", "TPOT@1 ms", "rounds tok/s", "note"], rows)


def roofline_section(r: dict | None) -> list[str]:
    if not r:
        return [PENDING]
    rows = [[str(b["batch_size"]), fmt(b["matmul_ms_per_step"], ".2f"), fmt(b["attention_ms_per_step"], ".3f"),
             fmt(b["matmul_gflops"]), fmt(b["bound_tokens_per_s"]), fmt(b["tandem_decode_tokens_per_s"]),
             fmt(b["percent_of_bound"], ".0f") + " %"] for b in r["batches"]]
    shapes = ", ".join(f"{k} {v[0]}x{v[1]}" + (f" (x{v[2]})" if v[2] > 1 else "") for k, v in r["shapes"].items())
    return [(f"{r['model']}, fp32, {r['threads']} threads. Decode GEMMs per step: {shapes}. Memory bandwidth "
             f"{r['memory_bandwidth_gb_s']:.1f} GB/s (tensor copy); weights {r['weight_bytes'] / 1e6:.0f} MB, so the "
             f"batch-1 memory-bound limit is {r['memory_bound_batch1_tokens_per_s']:.1f} tok/s. Attention: "
             f"{r['kv_bytes_per_request'] / 1e6:.2f} MB of KV read per request and step at that bandwidth."), ""] + \
        table(["batch", "matmul ms/step", "attention ms/step", "GEMM GFLOP/s", "bound tok/s", "tandem decode tok/s",
               "of bound"], rows)


def serve_section(serve: dict[int, dict], llama: dict[int, dict] | None = None) -> list[str]:
    if not serve:
        return [PENDING]
    lines = _serve_table(serve)
    if llama:
        lines += ["", ("The same workload against llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, "
                       "same GGUF file, same threads; text prompts of the same token count):"), ""]
        lines += _serve_table(llama)[2:]
        both = sorted(set(serve) & set(llama))
        for c in both:
            if llama[c]["output_throughput"]:
                lines += ["", f"At concurrency {c}: tandem serve / llama.cpp server output tok/s = "
                              f"{serve[c]['output_throughput'] / llama[c]['output_throughput']:.2f}x"]
    return lines


def _serve_table(serve: dict[int, dict]) -> list[str]:
    rows = [[str(c), str(m["num_prompts"]), f"{m['completed']} / {m['failed']}", fmt(m["output_throughput"]),
             fmt(m["mean_ttft_ms"]), fmt(m["p99_ttft_ms"]), fmt(m["mean_tpot_ms"], ".2f"), fmt(m["p99_itl_ms"]),
             fmt(m["mean_e2el_ms"], ".0f")] for c, m in sorted(serve.items())]
    return [("`tandem serve` (overlap loop) timed over HTTP by `tandem bench serve` (streaming /v1/completions, "
             "token-id prompts, ignore_eos); times in ms."), ""] + \
        table(["max concurrency", "prompts", "ok / failed", "output tok/s", "mean TTFT", "P99 TTFT", "mean TPOT",
               "P99 ITL", "mean E2EL"], rows)


def curves(peers: dict | None, serve: dict[int, dict]) -> tuple[list[int], dict[str, list]]:
    xs = sorted(set(serve) | set((peers or {}).get("sweep", {}) and peers["sweep"]["concurrency"] or []))
    out: dict[str, list] = {}
    if serve:
        out["tandem serve (HTTP)"] = [serve[c]["output_throughput"] if c in serve else None for c in xs]
    sweep = (peers or {}).get("sweep")
    if sweep:
        for name, values in sweep["engines"].items():
            by_c = dict(zip(sweep["concurrency"], values))
            if any(v is not None for v in values):
                out[f"{name} (offline)"] = [by_c.get(c) for c in xs]
    return xs, out


def plot(path: str, xs: list[int], lines: dict[str, list], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in lines.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (max requests in flight / batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def soak_section(s: dict | None) -> list[str]:
    if not s:
        return [PENDING]
    mem = [[proc, fmt(s["rss_mb_before"].get(proc), ".0f"), fmt(s["rss_mb_after"].get(proc), ".0f")]
           for proc in s["rss_mb_before"]]
    gauges = ", ".join(f"{k.split('{')[0].split(':')[1]} {v:g}" for k, v in s["gauges_after"].items())
    return [(f"{s['requests']} requests, {s['concurrency']} at a time, in {s['seconds']:.0f} s against a fresh "
             f"`tandem serve` with a fault injected for one kind of request (`tandem bench soak`). Kinds: "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["kinds"].items())) + ". Statuses: "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))
             + " (None: the client gave up first; every 500 is an injected fault)."), "",
            f"**Unexpected outcomes: {len(s['unexpected'])}.** After the run: /health {s['health_after']}, {gauges}.",
            "", *table(["process", "RSS before (MB)", "RSS after (MB)"], mem), "",
            ("The device process grows by the KV cache pages the run touched (the cache is allocated untouched, "
             "`kv_memory_fraction` of free memory) and the gather buffer; the frontend by its tokenizer pool and "
             "llguidance's view of the vocabulary, built at the first structured-output request.")]


def grammar_section(g: dict | None) -> list[str]:
    if not g:
        return ["_Not measured yet: run `.venv/bin/python benchmarks/grammar_overlap.py --json "
                "benchmarks/results/grammar_overlap.json`._"]
    rows = [[share, fmt(r["serial"]["tokens_per_s"], ".0f"), fmt(r["overlap"]["tokens_per_s"], ".0f"),
             fmt(r["overlap_over_serial"], ".2f"), fmt(r.get("bound"), ".2f"),
             fmt(100 * r["serial"]["device_idle_fraction"], ".1f") + " %",
             fmt(100 * r["overlap"]["device_idle_fraction"], ".1f") + " %",
             fmt(r["serial"]["host_ms_per_step"], ".2f"), fmt(r["serial"]["device_ms_per_step"], ".2f")]
            for share, r in g.items()]
    return [("`benchmarks/grammar_overlap.py`: the host-heavy config, a one-layer random Llama of width 64 with the "
             "full SmolLM2 vocabulary (the LM head and the sampling race over 49,152 tokens are most of a step), "
             "one device thread, 32 requests x up to 96 tokens, the given share of them under a JSON schema "
             "(sampled, temperature 0.8); loops in interleaved rounds on one engine. Bound: the serial run's "
             "(host + device) / max(host, device) per step. Goal at 100 %: overlap >= 1.2x serial, device idle "
             "<= 5 %."), "",
            *table(["requests under a grammar", "serial tok/s", "overlap tok/s", "overlap / serial", "bound",
                    "device idle serial", "device idle overlap", "host ms/step (serial)", "device ms/step"], rows)]


# ---- the headline page (RESULTS.md) --------------------------------------------------------------------------

VLLM_WORKLOADS = (("decode", "decode 64 x 32 -> 128"),
                  ("shared-prefix", "shared prefix 32 x (900 + 24) -> 32"),
                  ("multi-turn", "multi-turn 16 x 4 turns (128 new tokens a turn -> 32)"),
                  ("long", "long 8 x 1000-4000 -> 64"))
EPYC_FLAGS = ("avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_vbmi2 avx512_vp2intersect "
              "avx_vnni").split()          # lscpu of the AMD EPYC, as prefix_vs_vllm_epyc512_final.md quotes it
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_int8", "amx_bf16")     # the flags tandem's kernels dispatch on
VLLM = "vLLM CPU 0.32.0"
RUNS = (
    {"run": "A", "kind": "vllm", "peer": f"{VLLM} (AVX-512)", "json": "prefix_vs_vllm_epyc512_final.json",
     "note": "prefix_vs_vllm_epyc512_final.md", "date": "2026-12-04", "flags": EPYC_FLAGS,
     "command": ".venv/bin/python benchmarks/prefix_vs_vllm.py --vllm-python VENV/bin/python --rounds 3 "
                "--json benchmarks/results/prefix_vs_vllm_epyc512_final.json"},
    {"run": "B", "kind": "vllm", "peer": f"{VLLM}, both on AVX2 code (emulated)",
     "json": "prefix_vs_vllm_epyc_avx2_faithful.json", "note": "prefix_vs_vllm_epyc_avx2_faithful.md",
     "date": "2026-12-04", "flags": EPYC_FLAGS,
     "command": ".venv/bin/python benchmarks/prefix_vs_vllm.py --vllm-python VENV/bin/python --rounds 2 "
                "--json benchmarks/results/prefix_vs_vllm_epyc_avx2_faithful.json"},
    {"run": "C", "kind": "batch", "peer": "llama.cpp batched at 64 (llama-cpp-python 0.3.36, GGML_NATIVE)",
     "json": "batch_vs_llamacpp_epyc512_final.json", "note": "prefix_vs_vllm_epyc512_final.md",
     "date": "2026-12-04", "flags": EPYC_FLAGS},
    {"run": "D", "kind": "kl", "peer": "llama.cpp (llama-cpp-python 0.3.36), same GGUF",
     "json": "kl_divergence_decode_bf16.json", "peer_json": "kl_divergence_extend_bf16.json",
     "note": "kl_divergence_decode_bf16.md", "date": "2026-12-04",
     "tandem_row": "tandem int8, bfloat16 KV (default), decode op with bf16 products",
     "command": ".venv/bin/python benchmarks/kl_divergence.py --kv-dtypes bfloat16 --decode-attentions fp32,bf16 "
                "--out benchmarks/results/kl_divergence_decode_bf16.json",
     "peer_command": ".venv/bin/python benchmarks/kl_divergence.py --kv-dtypes bfloat16 --prefill-acts int8 "
                     "--prefill-attentions fp32,bf16 --out benchmarks/results/kl_divergence_extend_bf16.json"},
)


def need(res: str, name: str) -> dict:
    data = load(res, name)
    if data is None:
        raise SystemExit(f"render_results: {os.path.join(res, name)} is missing; the headline needs it")
    return data


def vllm_rows(run: dict, data: dict) -> list[list[str]]:
    rows = []
    for key, what in VLLM_WORKLOADS:
        w = data["workloads"][key]
        med = w["median_wall_s"]
        ratio = med["vllm"] / med["tandem"]
        assert abs(ratio - w["tandem_over_vllm"]) < 1e-9, (run["json"], key)
        n = len(w["rounds"]["tandem"])
        rows.append([run["peer"], f"{what}: wall s, median of {n} interleaved rounds", f"{med['tandem']:.2f} s",
                     f"{med['vllm']:.2f} s", f"**{w['tandem_over_vllm']:.2f}x**", run["run"]])
    return rows


def batch_rows(run: dict, data: dict) -> list[list[str]]:
    med = {k: statistics.median(v) for k, v in data["output_tok_s"].items()}
    n = len(data["output_tok_s"]["tandem"])
    return [[run["peer"], f"64 x 32 -> 128: output tok/s, median of {n} interleaved rounds",
             f"{med['tandem']:.1f}", f"{med['llama.cpp']:.1f}", f"**{med['tandem'] / med['llama.cpp']:.2f}x**",
             run["run"]]]


def kl_rows(run: dict, data: dict, peer: dict) -> list[list[str]]:
    ours, theirs = data["results"][run["tandem_row"]], peer["results"]["llama.cpp"]
    assert ours["tokens"] == theirs["tokens"] and data["model"] == peer["model"], "KL rows of different texts"
    return [[run["peer"], (f"KL divergence from fp32 (tandem's exact mode), mean nats over {ours['tokens']:,} "
                           f"positions of real text, {data['model']}: lower is better"),
             f"{ours['kl_mean']:.6f}", f"{theirs['kl_mean']:.6f}",
             f"**{ours['kl_mean'] / theirs['kl_mean']:.2f}x** its divergence", run["run"]]]


def cpu_text(run: dict, data: dict) -> str:
    m = data["machine"]
    have = set(m.get("flags") or run["flags"])
    flags = [f for f in ISA_FLAGS if f in have]
    text = (f"{m['cpu_model']}, {m['nproc']} vCPUs, {m['threads']} threads; " + " ".join(flags)
            + ("" if any(f.startswith("amx") for f in flags) else "; no AMX"))
    caps = m.get("isa_caps")
    return text + (f"; capped to AVX2 ({', '.join(f'`{k}={v}`' for k, v in caps.items())})" if caps else "")


def command_text(run: dict, data: dict) -> str:
    caps = data["machine"].get("isa_caps") or {}
    text = "`" + " ".join([f"{k}={v}" for k, v in caps.items()] + [run.get("command") or data["command"]]) + "`"
    if run.get("peer_command"):
        text += f"; llama.cpp's row, same text and file: `{run['peer_command']}`"
    return text


def data_links(run: dict) -> str:
    names = [run["json"]] + ([run["peer_json"]] if run.get("peer_json") else [])
    return ", ".join(f"[{n}](results/{n})" for n in names) + f", note: [{run['note']}](results/{run['note']})"


def headline(res: str) -> tuple[list[list[str]], list[list[str]]]:
    """The headline rows (one per figure) and the runs they come from (command, date, CPU, data)."""
    rows, runs = [], []
    for run in RUNS:
        data = need(res, run["json"])
        if run["kind"] == "vllm":
            rows += vllm_rows(run, data)
        elif run["kind"] == "batch":
            rows += batch_rows(run, data)
        else:
            rows += kl_rows(run, data, need(res, run["peer_json"]))
        runs.append([run["run"], command_text(run, data), run["date"], cpu_text(run, data),
                     data_links(run)])
    return rows, runs


def big_models_section(res: str) -> list[str]:
    """tandem against llama-bench on the 1.5B-8B-shaped Q4_K_M files (benchmarks/big_models.py)."""
    data = load(res, "big_models.json")
    if data is None:
        return ["_Not measured yet: run `.venv/bin/python benchmarks/big_models.py --json "
                "benchmarks/results/big_models.json`._"]
    rows = []
    avx2 = load(res, "big_models_avx2.json")        # the same run with tandem's AVX2 bodies (TANDEM_ISA=avx2)
    for r in data["rows"] + [dict(r, shape=r["shape"] + ", tandem on AVX2") for r in (avx2 or {}).get("rows", [])]:
        t, lb = r["tandem"], r.get("llama_bench", {})
        rows.append([r["shape"], fmt(r["file_bytes"] / 1e6, ".0f"), fmt(t["tpot_ms"], ".1f"),
                     fmt(r["bound_tpot_ms"], ".1f"), fmt(r["tpot_vs_bound"], ".2f"),
                     fmt(1e3 / lb["tg64"]["tokens_per_s"], ".1f") if lb else "-",
                     fmt(r.get("tpot_vs_llama_bench"), ".2f"), fmt(r.get("llama_bench_tpot_vs_bound"), ".2f"),
                     fmt(t["prefill_tokens_per_s"], ".1f"), fmt(lb["pp512"]["tokens_per_s"], ".1f") if lb else "-",
                     fmt(r.get("prefill_vs_llama_bench"), ".2f"), fmt(t["device_rss_mb"].get("VmRSS"), ".0f"),
                     "/".join(fmt(b, ".0f") for b in r["read_bandwidth_gb_s"])])
    m = data["machine"]
    return [("Synthetic files of the real shapes (tandem's GGUF writer, `tandem/model/gguf/synthetic.py`: random "
             "blocks in llama.cpp's Q4_K_M type mix), read by both engines; llama.cpp's own `llama-bench` built "
             f"from the llama-cpp-python sdist's source; {data['threads']} threads; CPU: {m.get('cpu_model')}. "
             "Bound: bytes a decode step reads over the best read bandwidth (a sum on the engine's threads) "
             "measured before, between and after the two engines' runs of that file (read GB/s). TPOT x: tandem's TPOT over the bound and over llama-bench's "
             "(below 1: tandem faster); prefill x: tandem's tokens/s over llama-bench pp512's. The read bandwidth "
             "of a shared host can move between runs (read GB/s: before tandem / between / after llama-bench), "
             "and the engines' ratios carry that noise. Rows \"tandem on AVX2\": tandem under TANDEM_ISA=avx2 (its AVX2 "
             "bodies on the same CPU) against the native llama-bench. "
             "Data: [results/big_models.json](results/big_models.json)."), "",
            *table(["shape", "file MB", "TPOT ms", "bound ms", "TPOT x bound", "llama-bench TPOT ms",
                    "TPOT x llama-bench", "llama-bench x bound", "prefill tok/s", "llama-bench pp512",
                    "prefill x", "device RSS MB", "read GB/s"], rows), *batch_line(res), *memory_lines(res)]


def memory_lines(res: str) -> list[str]:
    """Device RSS once idle (big_models_rss.json) and the q8_0 KV cache at 8k tokens (kv_q8_long_context.json)."""
    lines = []
    rss = load(res, "big_models_rss.json")
    if rss is not None:
        per = "; ".join(f"{r['shape']} {r['device_rss_mb']['VmRSS']:.0f} MB for a {r['file_bytes'] / 1e6:.0f} MB file "
                        f"({r['device_rss_busy_mb']['VmRSS']:.0f} right after the prefills)" for r in rss["rows"])
        lines += ["", f"Device RSS once idle (the device process gives freed activations back after 1 s without a "
                      f"step): {per} ([results/big_models_rss.json](results/big_models_rss.json))."]
    kv = load(res, "kv_q8_long_context.json")
    if kv is not None:
        base, q8 = kv["results"][0], kv["results"][-1]
        lines += ["", f"q8_0 KV cache (`--kv-cache-dtype q8_0`) on the {kv['model']} file at {kv['context']} tokens: "
                      f"{q8['kv_mb_at_context']:.0f} MB of KV against {base['kv_mb_at_context']:.0f} with "
                      f"{base['kv_cache_dtype']} ({q8['kv_bytes_vs_base']:.3f}x), decode TPOT {q8['tpot_ms']:.1f} ms "
                      f"against {base['tpot_ms']:.1f} ({q8['tpot_vs_base']:.2f}x) "
                      "([results/kv_q8_long_context.json](results/kv_q8_long_context.json))."]
    return lines


def batch_line(res: str) -> list[str]:
    """Batch decode on the 1.5B-shaped file against llama-server's slots (benchmarks/batch_vs_llama_server.py)."""
    b = load(res, "batch_vs_llama_server.json")
    if b is None:
        return []
    return ["", (f"Batch decode, {b['shape']}-shaped file, {b['rows']} x {b['prompt']} -> {b['out']} tokens sent at "
                 f"once: tandem {b['median']['tandem']:.1f} output tok/s, llama.cpp's `llama-server` with "
                 f"{b['slots']} parallel slots {b['median']['llama-server']:.1f}: "
                 f"**{b['tandem_over_llama_server']:.2f}x** (median of interleaved rounds; "
                 "[results/batch_vs_llama_server.json](results/batch_vs_llama_server.json)).")]


def render_headline(out: str, res: str) -> str:
    rows, runs = headline(res)
    vllm_dtype = need(res, RUNS[0]["json"])["vllm_command"]
    dtype = vllm_dtype[vllm_dtype.index("--dtype") + 1]
    md = ["# tandem: results today", "",
          "Regenerate this page from the JSON files it names: `python3 benchmarks/render_results.py`.", "",
          ("Every row is tandem against a peer on the same machine and the same model file: SmolLM2-135M-Instruct "
           "Q4_1 GGUF (tandem's default, `LLM()`), tandem in its default configuration, vLLM on the same weights "
           f"dequantized ({dtype}, prefix caching on). The throughput rows run both engines in interleaved rounds "
           "(the order alternating) on the same token-id prompts, greedy. Ratio: how many times faster tandem is "
           "(the peer's wall time over tandem's, or tandem's output tok/s over the peer's); for the KL row, "
           "tandem's divergence over the peer's."), "",
          "## Headline", "",
          *table(["peer", "what was measured", "tandem", "peer", "ratio", "run"], rows), "",
          "## Runs", "",
          ("`VENV`: the vLLM CPU venv of [docs/performance.md](../docs/performance.md#peers-vllm-cpu-and-llamacpp); "
           "the AVX2 rows cap both engines to their AVX2 code on the same CPU (the instruction mix of an AVX2 "
           "machine, not its clocks or memory bandwidth)."), "",
          *table(["run", "command", "date", "CPU", "data"], runs), "",
          "## Models of the size users run", "",
          *big_models_section(res), "",
          "## Everything else", "",
          ("Each figure's note (linked above) says what the run measured and where the time goes. Every earlier "
           "measurement, per kernel, per issue and per machine (Intel Xeon with AMX, AVX2-only AMD EPYC, the "
           "AVX-512 EPYC), with the older RESULTS.md page as it stood, is kept in "
           "[results/HISTORY.md](results/HISTORY.md); `benchmarks/run_all.py` renders its own sweep (offline, "
           "peers, roofline, serving, soak) into [results/run_all.md](results/run_all.md). How to run the peers and "
           "the benchmarks: "
           "[docs/performance.md](../docs/performance.md).")]
    return write_page(os.path.join(out, "RESULTS.md"), md)


# ---- benchmarks/run_all.py's sweep page (results/run_all.md) ------------------------------------------------

def render_sweep(out: str, res: str) -> str:
    """results/run_all.md (and the plot beside RESULTS.md) from the JSON files run_all.py writes."""
    run = load(res, "run.json")
    off = {loop: load(res, f"offline_{loop}.json") for loop in ("overlap", "serial")}
    peers, roof = load(res, "peers.json"), load(res, "roofline.json")
    serve = {int(re.search(r"serve_c(\d+)\.json$", p).group(1)): load(res, os.path.basename(p))
             for p in glob.glob(os.path.join(res, "serve_c*.json"))}
    llama = {int(re.search(r"serve_c(\d+)\.json$", p).group(1)): load(res, os.path.basename(p))
             for p in glob.glob(os.path.join(res, "llamacpp_serve_c*.json"))}
    md = ["# benchmarks/run_all.py: the sweep", ""]
    if run:
        md += [(f"Generated by `benchmarks/run_all.py` on {run['date']} in {run['minutes']:.0f} minutes; rerun it "
                f"to regenerate this file (`--render` rewrites it from `benchmarks/results/*.json`)."),
               "", "## Machine", ""]
        md += table(["", ""], [[k, str(v)] for k, v in run["machine"].items()])
        md += ["", "## Commands", "", "```", f"# {run['invocation']}", *run["commands"], "```"]
    else:
        md += ["Placeholders: nothing has been measured yet. On a quiet machine run", "",
               "```", ".venv/bin/python benchmarks/run_all.py", "```", "",
               ("(about 30 minutes on 2 cores); it rewrites this file from `benchmarks/results/*.json` and draws "
                f"`benchmarks/{PLOT}`."), "", "## Machine", "", PENDING, "", "## Commands", "", PENDING]
    md += ["", "## Offline throughput (`tandem bench offline`)", "", *offline_section(off)]
    md += ["", "## tandem vs peers (`tandem bench peers`)", "", *peers_section(peers)]
    md += ["", "## Roofline (`tandem bench roofline`)", "", *roofline_section(roof)]
    md += ["", "## Serving (`tandem bench serve` against `tandem serve`)", "", *serve_section(serve, llama)]
    md += ["", "## Structured output and the overlap (`benchmarks/grammar_overlap.py`)", "",
           *grammar_section(load(res, "grammar_overlap.json"))]
    md += ["", "## Chaos soak (`tandem bench soak`)", "", *soak_section(load(res, "soak.json"))]
    md += ["", "## Output tokens/s vs concurrency", ""]
    xs, lines = curves(peers, serve)
    if lines:
        src = peers or next(iter(serve.values()))
        title = (f"{src.get('model') or src.get('model_id')}: {src['input_len']} tokens in, {src['output_len']} out"
                 + (f", {run['machine']['nproc']} cores ({run['machine']['CPU model']})" if run else ""))
        plot(os.path.join(out, PLOT), xs, lines, title)
        md += [("tandem serve over HTTP at `--max-concurrency c`; every engine's offline API at batch (running "
                "cap) c, on max(4, c) prompts each."), ""]
        md += table(["engine"] + [f"c={x}" for x in xs], [[n] + [fmt(v) for v in ys] for n, ys in lines.items()])
        md += ["", f"![output tokens/s vs concurrency](../{PLOT})"]
    else:
        md += [PENDING]
    return write_page(os.path.join(res, "run_all.md"), md)


def write_page(path: str, md: list[str]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {path}")
    return path


def render(out: str, res: str) -> None:
    """What run_all.py calls: its sweep page, then the headline page (only for the repository's own folder: a
    smoke run elsewhere has none of the headline's JSON files)."""
    render_sweep(out, res)
    if os.path.abspath(out) == HERE:
        render_headline(HERE, os.path.join(HERE, "results"))


if __name__ == "__main__":
    render_headline(HERE, os.path.join(HERE, "results"))
