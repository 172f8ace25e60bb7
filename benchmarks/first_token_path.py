"""Which arithmetic should prompt rows take (issue 44, item 5)? A prompt's last row decides the first token a user
sees, so a more accurate path there would change what the defaults answer. Compared against the exact mode
(kernels_act="fp32"):
  - "int8 (default)": the default settings: every prompt row runs the int8 linears and attends with the decode
    op's arithmetic (the causal op; an earlier version of the rule attended them by the extend op);
  - "bf16 prompt rows": every prompt row, whatever its chunk's length, through the bf16 GEMM (prefill_act="bf16",
    the long-chunk path of AMX machines) with bf16 attention products; decode rows keep int8. tandem offers this
    path only for chunks longer than small_m() and only without batch invariance, so this script lowers that
    threshold to 0 in its own process (device_backend="inline"): the measurement of a path, not a mode.
Figures: KL(exact || mode) over >= 4k teacher-forced positions of real text (each position is a prompt row),
greedy agreement with the exact mode over >= 64 chat prompts (first token, and all of --tokens), TTFT (median of
the chat prompts one at a time) and TPOT (1 x 32 -> 128).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/first_token_path.py --json results/first_token_path.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from batch_invariance_cost import tpot

from tandem import LLM, SamplingParams
from tandem.bench import machine_info
from tandem.bench.accuracy import divergence, real_text, teacher_forced_logprobs
from tandem.model.llama import LlamaModel

MODES = {"exact": dict(kernels_act="fp32"),
         "int8 (default)": dict(),
         "bf16 prompt rows": dict(batch_invariant=False, prefill_act="bf16")}


def bulk_from_every_prompt_row(self, t, meta) -> int:
    """LlamaModel._bulk_from without its length test: a step's prompt rows, whatever their count, take the bf16
    linears (decode rows keep int8, and pure decode steps their fused layer op)."""
    if not self.prefill_bf16:
        return t
    if meta.parts is not None:
        rows, m = meta.parts[-1]
        return rows.start if m.q_index is not None else t
    return 0 if meta.q_index is not None else t


def chat_prompts(n: int) -> list[list[dict]]:
    """n one-turn chats: a question about each of n Python reference topics (pydoc_data, shipped with Python)."""
    from pydoc_data.topics import topics
    names = sorted(topics)[:n]
    forms = ("In one sentence, what is Python's {}?", "Explain {} in Python to a beginner.",
             "Give one example of {} in Python.", "What is a common mistake with {} in Python?")
    return [[{"role": "user", "content": forms[i % len(forms)].format(t)}] for i, t in enumerate(names)]


def build(mode: str, threads: int) -> LLM:
    return LLM(device_backend="inline", device_threads=threads, prefix_cache=False, **MODES[mode])


def measure(mode: str, docs: list[list[int]], chats: list, args) -> dict:
    """Teacher-forced logprobs, greedy chat answers, TTFT and TPOT of one mode."""
    orig = LlamaModel._bulk_from
    if mode == "bf16 prompt rows":                  # every prompt chunk takes the bulk (bf16) rows
        LlamaModel._bulk_from = bulk_from_every_prompt_row
    try:
        llm = build(mode, args.threads)
        try:
            lps = [teacher_forced_logprobs(llm, d) for d in docs]
            greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            answers, ttft = [], []
            for chat in chats:
                t = time.perf_counter()
                llm.chat([chat], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                ttft.append(time.perf_counter() - t)
                answers.append(llm.chat([chat], greedy, use_tqdm=False)[0].token_ids)
            return {"lps": lps, "answers": answers, "ttft_s": statistics.median(ttft), "tpot_s": tpot(llm, 7)}
        finally:
            llm.shutdown()
    finally:
        LlamaModel._bulk_from = orig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=4096, help="teacher-forced positions at least")
    ap.add_argument("--doc-tokens", type=int, default=512, help="tokens per document at most")
    ap.add_argument("--chats", type=int, default=64, help="chat prompts of the greedy agreement")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per chat prompt")
    ap.add_argument("--threads", type=int, default=2, help="device threads")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    tok = build("int8 (default)", 1)
    docs, total = [], 0
    for text in real_text(10 ** 8):
        ids = tok.tokenizer.encode(text)[:args.doc_tokens]
        docs.append(ids)
        total += len(ids) - 1
        if total >= args.positions:
            break
    tok.shutdown()
    chats = chat_prompts(args.chats)
    got = {m: measure(m, docs, chats, args) for m in MODES}
    ref = got["exact"]
    summary = {}
    for m, g in got.items():
        d = divergence(torch.cat(ref["lps"]), torch.cat(g["lps"]))
        pairs = list(zip(g["answers"], ref["answers"]))
        summary[m] = {"positions": d.tokens, "kl_mean": round(d.kl_mean, 6), "kl_p99": round(d.kl_p99, 5),
                      "top1_agree": round(d.top1_agree, 4),
                      "first_token_as_exact": f"{sum(a[:1] == b[:1] for a, b in pairs)}/{len(pairs)}",
                      "answer_as_exact": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
                      "ttft_ms": round(g["ttft_s"] * 1e3, 2), "tpot_ms": round(g["tpot_s"] * 1e3, 3)}
        print(json.dumps({m: summary[m]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "summary": summary}, f, indent=1)
    print(f"{len(docs)} documents, {total} positions, {len(chats)} chats", file=sys.stderr)


if __name__ == "__main__":
    main()
