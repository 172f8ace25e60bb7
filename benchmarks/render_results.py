"""RESULTS.md and throughput_vs_concurrency.png from the JSON files benchmarks/run_all.py writes.

A section whose JSON is missing (not run yet, or its command failed) is rendered as a placeholder.
"""
from __future__ import annotations

import glob
import json
import os
import re

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


def render(out: str, res: str) -> str:
    run = load(res, "run.json")
    off = {loop: load(res, f"offline_{loop}.json") for loop in ("overlap", "serial")}
    peers, roof = load(res, "peers.json"), load(res, "roofline.json")
    serve = {int(re.search(r"serve_c(\d+)\.json$", p).group(1)): load(res, os.path.basename(p))
             for p in glob.glob(os.path.join(res, "serve_c*.json"))}
    llama = {int(re.search(r"serve_c(\d+)\.json$", p).group(1)): load(res, os.path.basename(p))
             for p in glob.glob(os.path.join(res, "llamacpp_serve_c*.json"))}
    md = ["# tandem benchmark results", ""]
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
        md += ["", f"![output tokens/s vs concurrency]({PLOT})"]
    else:
        md += [PENDING]
    for extra in sorted(glob.glob(os.path.join(res, "*.md"))):    # sections measured by hand, kept verbatim
        with open(extra) as f:
            md += ["", f.read().rstrip("\n")]
    path = os.path.join(out, "RESULTS.md")
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {path}")
    return path
