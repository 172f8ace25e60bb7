"""Speculative decoding (n-gram prompt lookup), single stream, SmolLM2-135M Q4_1 on the CPU: TPOT of tandem with
speculation on (overlap and serial loops) against tandem with it off, llama.cpp plain and llama.cpp with its
prompt-lookup draft (llama_cpp.llama_speculative.LlamaPromptLookupDecoding), all in one run; acceptance rate and
mean accepted length per workload; and 64 requests x 32 -> 128 tokens throughput with speculation on vs off.

Workloads: (a) quoting and editing (repeat a passage, fix a typo in code), (b) a multi-turn chat that quotes an
earlier turn, (c) open-ended text. Greedy, ignore_eos, the same prompt ids for every peer; TPOT is the time from
the first to the last of `--output-len` tokens over their gaps (prefill excluded); with --stop-at-eos each answer
ends at its EOS, so the TPOT is that of the answer itself (a quote ends where the passage does, instead of going on
past EOS into text the prompt does not hold).

    tandem bench speculative --json speculative.json      # or benchmarks/speculative.py (writes results/)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from tandem import LLM, SamplingParams
from tandem.scheduler import speculative as spec_mod

PASSAGE = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin "
           "nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass doors "
           "of Victory Mansions, though not quickly enough to prevent a swirl of gritty dust from entering along "
           "with him. The hallway smelt of boiled cabbage and old rag mats.")
CODE = ("def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
        "    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n"
        "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
        "            out.append(total / widnow)\n    return out\n")
WORKLOADS = {
    "a_quote": [{"role": "user", "content": "Repeat the following passage exactly, word for word:\n\n" + PASSAGE}],
    "a_edit_code": [{"role": "user", "content": "Fix the typo in this Python function and print the whole "
                                                "corrected function:\n\n" + CODE}],
    "b_multi_turn": [{"role": "user", "content": "Here is a passage I like:\n\n" + PASSAGE},
                     {"role": "assistant", "content": "Thank you for sharing it. It is the opening of Nineteen "
                                                      "Eighty-Four by George Orwell."},
                     {"role": "user", "content": "Quote the passage I gave you again, exactly."}],
    "c_open_ended": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
                                                 "message in a bottle."}],
}
ALWAYS_AHEAD = "tandem spec overlap, always ahead"      # AHEAD_MIN_HOLD 0: every drafting step picked ahead
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def tandem_tpot(llm: LLM, ids: list[int], n: int, stop: bool = False) -> tuple[float, dict]:
    """Seconds per output token after the first (from the engine's own output times), and the spec stats delta.
    stop: the answer ends at EOS (at most n tokens), else n tokens past it."""
    eng = llm.engine
    times: list[float] = []
    old = eng._sink

    def sink(outputs):
        t = time.perf_counter()
        times.extend([t] * sum(len(o.new_token_ids) for o in outputs))
        old(outputs)

    before = llm.stats()
    eng._sink = sink
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=not stop), use_tqdm=False)
    finally:
        eng._sink = old
    after = llm.stats()
    assert len(times) == n or (stop and 1 < len(times) < n), len(times)
    delta = {k: after[k] - before.get(k, 0) for k in after if k.startswith("spec_")}
    delta["tokens"] = len(times)
    return (times[-1] - times[0]) / (len(times) - 1), delta


def device_idle(llm: LLM) -> float:
    """1 - busy / span over the decode forwards (prefill excluded) the recorder holds."""
    dev = [d for d in llm.engine.recorder.devices if not d.is_prefill]
    if len(dev) < 2:
        return 0.0
    span = dev[-1].end - dev[0].start
    return 1.0 - sum(d.end - d.start for d in dev) / span if span > 0 else 0.0


def llama_tpot(llm, ids: list[int], n: int, stop: bool = False) -> float:
    llm.reset()
    times = []
    eos = llm.token_eos()
    for k, tok in enumerate(llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0), 1):
        times.append(time.perf_counter())
        if k == n or (stop and tok == eos):
            break
    return (times[-1] - times[0]) / (len(times) - 1)


def throughput(llm: LLM, spec: dict, on: bool, num: int, in_len: int, out_len: int, vocab: int) -> float:
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(num)]
    llm.engine.config = llm.engine.config.replace(scheduler="overlap", speculative_config=spec if on else None)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    return num * out_len / (time.perf_counter() - t)


TANDEM_RUNS = {"tandem spec off": ("overlap", False), "tandem spec overlap": ("overlap", True),
               "tandem spec serial": ("serial", True), ALWAYS_AHEAD: ("overlap", True)}     # peer: (loop, speculating)


def llama_peers(path: str, threads: int, spec: dict) -> tuple[dict, dict]:
    """llama.cpp plain and with its prompt-lookup draft, by peer name; or why they are skipped."""
    peers: dict = {}
    skipped: dict = {}
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        kw = dict(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        peers["llama.cpp plain"] = Llama(**kw)
        peers["llama.cpp prompt lookup"] = Llama(**kw, draft_model=LlamaPromptLookupDecoding(
            max_ngram_size=spec.get("prompt_lookup_max", 4), num_pred_tokens=spec.get("num_speculative_tokens", 4)))
    except ImportError as e:
        skipped["llama.cpp"] = f"{type(e).__name__}: {e}"
    return peers, skipped


def tandem_run(llm: LLM, peer: str, ids: list[int], args: argparse.Namespace) -> tuple[float, dict]:
    """One TPOT run of a tandem peer (TANDEM_RUNS) on a fresh recorder; ALWAYS_AHEAD drops the hold for it."""
    loop, on = TANDEM_RUNS[peer]
    spec = args.speculative_config
    llm.engine.config = llm.engine.config.replace(scheduler=loop, speculative_config=spec if on else None)
    llm.engine.recorder.clear()
    hold = spec_mod.AHEAD_MIN_HOLD
    spec_mod.AHEAD_MIN_HOLD = 0.0 if peer == ALWAYS_AHEAD else hold
    try:
        return tandem_tpot(llm, ids, args.output_len, args.stop_at_eos)
    finally:
        spec_mod.AHEAD_MIN_HOLD = hold


def workload_rounds(llm: LLM, peers: dict, name: str, ids: list[int], args: argparse.Namespace, res: dict) -> None:
    """args.rounds of every tandem peer and then every llama.cpp peer on one workload, into res: tpot (seconds
    per peer), and for the speculating runs spec_stats, device idle (idle, idle_off: the same loop without
    speculation, the reference for the idle goal) and loops (idle, steps, picks ahead per run)."""
    tandem_tpot(llm, ids, 4)                       # warm the prefix cache the same way for every tandem run
    for _ in range(args.rounds):
        for peer, (_, on) in TANDEM_RUNS.items():
            t, delta = tandem_run(llm, peer, ids, args)
            res["tpot"].setdefault(name, {}).setdefault(peer, []).append(t)
            if peer == "tandem spec overlap":
                res["spec_stats"][name] = delta
                res["idle"][name] = device_idle(llm)
            if peer == "tandem spec off":
                res["idle_off"][name] = device_idle(llm)
            if on:
                res["loops"].setdefault(name, {})[peer] = {
                    "device_idle": device_idle(llm), "ahead": delta.get("spec_ahead_drafts", 0),
                    "dropped": delta.get("spec_ahead_dropped", 0),
                    "decode_steps": sum(1 for d in llm.engine.recorder.devices if not d.is_prefill)}
        for peer, model in peers.items():
            res["tpot"][name].setdefault(peer, []).append(llama_tpot(model, ids, args.output_len, args.stop_at_eos))


def draft_model_runs(args: argparse.Namespace, prompts: dict, tpot: dict) -> dict:
    """--draft-model: each workload's TPOT with method draft_model (into tpot) and its spec stats delta."""
    from ..model.loader import default_model_path
    draft_stats: dict[str, dict] = {}
    if not args.draft_model:
        return draft_stats
    spec = args.speculative_config
    path = default_model_path() if args.draft_model == "self" else args.draft_model
    dspec = {"method": "draft_model", "model": path, "num_speculative_tokens": spec.get("num_speculative_tokens", 4)}
    dllm = LLM(device_threads=args.threads, speculative_config=dspec)
    try:
        for name, ids in prompts.items():
            tandem_tpot(dllm, ids, 4)
            t, delta = tandem_tpot(dllm, ids, args.output_len, args.stop_at_eos)
            tpot[name]["tandem draft model"] = [t]
            draft_stats[name] = delta
    finally:
        dllm.shutdown()
    return draft_stats


def throughputs(llm: LLM, spec: dict, requests: int) -> dict:
    """Output tokens/s of `requests` x 32 -> 128, speculation off and on, twice each (none for 0 requests)."""
    tp = {}
    if requests:
        vocab = llm.engine.model_config.vocab_size
        throughput(llm, spec, False, 8, 32, 8, vocab)  # warm-up
        for on in (False, True, False, True):
            tp.setdefault("on" if on else "off", []).append(throughput(llm, spec, on, requests, 32, 128, vocab))
    return tp


def bench_speculative(args: argparse.Namespace) -> dict:
    """The whole run; args: threads, output_len, rounds, throughput_requests, speculative_config (dict)."""
    spec = args.speculative_config
    llm = LLM(device_threads=args.threads, speculative_config=spec)
    tok = llm.tokenizer
    prompts = {name: tok.encode(llm.apply_chat_template(m), add_special_tokens=False) for name, m in WORKLOADS.items()}
    from ..model.loader import default_model_path
    peers, skipped = llama_peers(default_model_path(), args.threads, spec)
    res: dict[str, dict] = {"tpot": {}, "spec_stats": {}, "idle": {}, "idle_off": {}, "loops": {}}
    for name, ids in prompts.items():
        workload_rounds(llm, peers, name, ids, args, res)
        print(name, {k: round(1e3 * statistics.median(v), 2) for k, v in res["tpot"][name].items()}, flush=True)
    draft_stats = draft_model_runs(args, prompts, res["tpot"])
    tp = throughputs(llm, spec, args.throughput_requests)
    llm.shutdown()
    return {"output_len": args.output_len, "stop_at_eos": args.stop_at_eos, "threads": args.threads,
            "speculative_config": spec, "rounds": args.rounds,
            "throughput_requests": args.throughput_requests, "skipped": skipped,
            "tpot_ms": {w: {k: 1e3 * statistics.median(v) for k, v in d.items()} for w, d in res["tpot"].items()},
            "spec_stats": res["spec_stats"], "device_idle_overlap": res["idle"],
            "device_idle_overlap_off": res["idle_off"], "loops": res["loops"], "draft_model": args.draft_model,
            "draft_stats": draft_stats,
            "throughput_tok_s": {k: statistics.median(v) for k, v in tp.items()}}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="threads of tandem's device process and of llama.cpp")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per workload")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="each answer ends at EOS (at most --output-len tokens; TPOT over the answer itself), "
                        "instead of --output-len tokens past it (ignore_eos)")
    p.add_argument("--rounds", type=int, default=1, help="rounds per peer and workload (the table takes the median)")
    p.add_argument("--throughput-requests", type=int, default=64,
                   help="requests of the 32 -> 128 throughput check, speculation on vs off (0: skip)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="also time method draft_model with this draft ('self': the target as its own draft)")
    p.add_argument("--speculative-config", type=json.loads, default=SPEC,
                   help=f"the speculative_config tandem runs with, as JSON (default: {json.dumps(SPEC)})")


def render(out: dict) -> str:
    lines = [f"# Speculative decoding (n-gram), single stream, SmolLM2-135M Q4_1, {out['threads']} threads",
             "", f"Greedy, {out['output_len']} output tokens "
             f"({'at most: each answer ends at EOS' if out.get('stop_at_eos') else 'ignore_eos'}), median of "
             f"{out['rounds']} round(s); "
             f"speculative_config `{json.dumps(out['speculative_config'])}`. TPOT in ms (prefill excluded). "
             "Ratios < 1 are faster. Acceptance = accepted / drafted tokens; mean accepted length = tokens a "
             "verify step kept (accepted drafts + 1).", "",
             "| workload | tandem off | tandem spec (overlap) | tandem spec (serial) | llama.cpp plain | "
             "llama.cpp prompt lookup | spec / tandem off | spec / best llama.cpp | acceptance | mean accepted "
             "length | device idle (overlap, spec) | device idle (overlap, off) | tokens (spec overlap) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w, d in out["tpot_ms"].items():
        st = out["spec_stats"].get(w, {})
        runs = sum(v for k, v in st.items() if k.startswith("spec_accepted_len_"))
        drafted, acc = st.get("spec_draft_tokens", 0), st.get("spec_accepted_tokens", 0)
        best = min([d[k] for k in ("llama.cpp plain", "llama.cpp prompt lookup") if k in d] or [float("nan")])
        spec = min(d["tandem spec overlap"], d["tandem spec serial"])
        cell = lambda k: f"{d[k]:.2f}" if k in d else "-"  # noqa: E731
        off_idle = (f"{100 * out['device_idle_overlap_off'][w]:.1f} %" if w in out.get("device_idle_overlap_off", {})
                    else "-")
        lines.append(f"| {w} | {cell('tandem spec off')} | {cell('tandem spec overlap')} | "
                     f"{cell('tandem spec serial')} | {cell('llama.cpp plain')} | {cell('llama.cpp prompt lookup')} | "
                     f"{spec / d['tandem spec off']:.2f}x | {spec / best:.2f}x | "
                     f"{acc / drafted if drafted else 0:.2f} | {1 + acc / runs if runs else 1:.2f} | "
                     f"{100 * out['device_idle_overlap'].get(w, 0):.1f} % | {off_idle} | {st.get('tokens', '-')} |")
    if out.get("loops"):
        runs = ("tandem spec serial", "tandem spec overlap", ALWAYS_AHEAD)
        lines += ["", "Drafting steps in the loops (last round): device idle over the decode forwards, decode steps "
                      "for the output, drafting steps picked while the previous one ran (ahead) and of those dropped "
                      "(the assumption failed). Overlap: picked ahead while a request's runs hold "
                      "(AHEAD_MIN_HOLD); always ahead: AHEAD_MIN_HOLD 0.", "",
                  "| workload | " + " | ".join(f"{r[len('tandem spec '):]} {c}" for r in runs
                                              for c in ("idle", "steps", "ahead / dropped")) + " | always ahead TPOT ms |",
                  "|---" * (3 * len(runs) + 2) + "|"]
        for w, d in out["loops"].items():
            cells = []
            for r in runs:
                x = d.get(r, {})
                cells += [f"{100 * x.get('device_idle', 0):.1f} %", str(x.get("decode_steps", "-")),
                          f"{x.get('ahead', 0)} / {x.get('dropped', 0)}"]
            lines.append(f"| {w} | " + " | ".join(cells) + f" | {out['tpot_ms'][w].get(ALWAYS_AHEAD, float('nan')):.2f} |")
    if out.get("draft_stats"):
        lines += ["", f"Draft model `{out['draft_model']}` (method draft_model, overlap loop; the target as its own "
                      "draft only shows coupled draws at work: it costs a second forward of the same size):", "",
                  "| workload | TPOT ms | / tandem off | acceptance | mean accepted length |", "|---|---|---|---|---|"]
        for w, st in out["draft_stats"].items():
            d = out["tpot_ms"][w]
            runs = sum(v for k, v in st.items() if k.startswith("spec_accepted_len_"))
            drafted, acc = st.get("spec_draft_tokens", 0), st.get("spec_accepted_tokens", 0)
            lines.append(f"| {w} | {d['tandem draft model']:.2f} | {d['tandem draft model'] / d['tandem spec off']:.2f}x"
                         f" | {acc / drafted if drafted else 0:.2f} | {1 + acc / runs if runs else 1:.2f} |")
    tp = out["throughput_tok_s"]
    if tp:
        lines += ["", f"{out['throughput_requests']} requests x 32 -> 128 tokens (overlap loop): {tp['off']:.1f} tok/s "
                      f"speculation off, "
                      f"{tp['on']:.1f} tok/s on: {tp['on'] / tp['off']:.3f}x (above disable_by_batch_size the "
                      "batch runs without speculation)."]
    if out.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in out["skipped"].items())]
    return "\n".join(lines) + "\n"
