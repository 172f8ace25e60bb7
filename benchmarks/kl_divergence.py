"""The accuracy gate of the int8-activation default (issue 17): over >= 4k tokens of real text, the KL divergence
of tandem's next-token distributions from the fp32 reference (tandem's exact mode, kernels_act="fp32") beside
llama.cpp's own on the same GGUF, and the greedy agreement of each with the exact mode.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/kl_divergence.py [--model M.gguf] [--tokens 4096]

Text: the longest topics of Python's language reference (pydoc_data, shipped with every Python), each cut to
--doc-tokens, tokenized once by tandem's tokenizer; llama.cpp gets the same ids (logits_all). Greedy agreement:
--greedy prompts (the first 32 tokens of the documents), --greedy-tokens each, per engine against the exact
mode: prompts identical to the end, and the mean count of tokens before the first difference. Writes
benchmarks/results/kl_divergence.json (the .md beside it is written by hand from it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from tandem import LLM, SamplingParams, kernels
from tandem.bench import machine_info
from tandem.bench.accuracy import divergence, llama_cpp_logprobs, real_text, teacher_forced_logprobs
from tandem.model.numerics import AUTO_KV_DTYPE
from tandem.kernels.quant import small_m
from tandem.model.loader import default_model_path

p = argparse.ArgumentParser()
p.add_argument("--model", default=None, help="a GGUF file (default: the default SmolLM2 Q4_1)")
p.add_argument("--tokens", type=int, default=4096, help="teacher-forced positions at least")
p.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document at most")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--greedy", type=int, default=8, help="prompts of the greedy agreement")
p.add_argument("--greedy-tokens", type=int, default=64)
p.add_argument("--kv-dtypes", default="bfloat16,float16,float32",
               help="KV cache dtypes of the int8 runs (comma-separated, e.g. bfloat16,q8_0; bfloat16 is the default's)")
p.add_argument("--prefill-acts", default="",
               help="also these prefill_act values (comma-separated, e.g. int8,bf16) with every document one "
                    "prefill chunk (the long-prompt path: bf16 GEMM + SDPA, not the decode rows')")
p.add_argument("--prefill-attentions", default="auto",
               help="prefill_attention values of the --prefill-acts runs (comma-separated, e.g. fp32,bf16: the "
                    "native extend op's fp32 or bf16 products)")
p.add_argument("--decode-attentions", default="",
               help="also the bf16-KV int8 run with these decode_attention values (comma-separated, e.g. fp32,bf16: "
                    "the native decode op's fp32 or bf16 products; the prompt chunks run it, as decode rows do)")
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                             "kl_divergence.json"))
cli = p.parse_args()
path = cli.model or default_model_path()
kernels.available()               # small_m() asks the loaded library which ISA runs
chunk = min(64, small_m())        # prompt chunks that take the in-kernel rows, as a decode step does


def engine(act: str, kv: str = "auto", prefill_act: str = "auto", prefill_chunk: int = chunk,
           prefill_attention: str = "auto", decode_attention: str = "auto", batch_invariant: bool = True) -> LLM:
    return LLM(path, kernels_act=act, kv_cache_dtype=kv, device_backend="inline", device_threads=cli.threads,
               max_prefill_tokens=prefill_chunk, kv_cache_tokens=cli.doc_tokens + 256, prefix_cache=False,
               prefill_act=prefill_act, prefill_attention=prefill_attention, decode_attention=decode_attention,
               batch_invariant=batch_invariant)


exact = engine("fp32")
tok = exact.tokenizer
docs, total = [], 0
for text in real_text(10 ** 8):
    ids = tok.encode(text)[:cli.doc_tokens]
    if len(ids) < 64:
        continue
    docs.append(ids)
    total += len(ids) - 1
    if total >= cli.tokens:
        break
assert total >= cli.tokens, f"only {total} tokens of text"
prompts = [d[:32] for d in docs[:cli.greedy]] + [d[32:64] for d in docs[:max(0, cli.greedy - len(docs))]]
greedy = SamplingParams(temperature=0, max_tokens=cli.greedy_tokens, ignore_eos=True)
print(f"{len(docs)} documents, {total} positions", file=sys.stderr)

ref = [teacher_forced_logprobs(exact, d) for d in docs]
ref_greedy = [o.token_ids for o in exact.generate(prompts, greedy, use_tqdm=False)]
exact.shutdown()


def agreement(outs: list[list[int]]) -> dict:
    same = sum(o == r for o, r in zip(outs, ref_greedy))
    before = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, ref_greedy)]
    return {"prompts_identical": f"{same}/{len(outs)}", "mean_tokens_before_first_difference":
            round(sum(before) / len(before), 1), "tokens_each": cli.greedy_tokens}


def summary(tests: list[torch.Tensor]) -> dict:
    d = divergence(torch.cat(ref), torch.cat(tests))
    return {"tokens": d.tokens, "kl_mean": round(d.kl_mean, 6), "kl_p99": round(d.kl_p99, 5),
            "top1_agree": round(d.top1_agree, 4)}


results: dict = {}
for kv in cli.kv_dtypes.split(","):
    llm = engine("int8", kv)
    got = str(llm.engine.executor.model_runner.kv_cache.data.dtype).removeprefix("torch.")
    got = "q8_0" if got == "uint8" else got                             # q8_0 blocks are held as bytes
    assert got == kv, f"asked for a {kv} KV cache, got {got}"
    name = f"tandem int8, {kv} KV" + (" (default)" if getattr(torch, kv, None) == AUTO_KV_DTYPE else "")
    name += ", decode op with bf16 products" if llm.engine.executor.model_runner.model.decode_bf16 else ""
    results[name] = {**summary([teacher_forced_logprobs(llm, d) for d in docs]),
                     "greedy": agreement([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])}
    llm.shutdown()
for attn in filter(None, cli.decode_attentions.split(",")):
    llm = engine("int8", "bfloat16", decode_attention=attn)
    what = "bf16 products" if llm.engine.executor.model_runner.model.decode_bf16 else "fp32"
    results[f"tandem int8, bfloat16 KV, decode_attention={attn} ({what})"] = {
        **summary([teacher_forced_logprobs(llm, d) for d in docs]),
        "greedy": agreement([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])}
    llm.shutdown()
for pa in filter(None, cli.prefill_acts.split(",")):
    for attn in cli.prefill_attentions.split(","):
        llm = engine("int8", prefill_act=pa, prefill_chunk=cli.doc_tokens, prefill_attention=attn,
                     batch_invariant=False)      # the extend op / bf16 SDPA of whole-document chunks
        model = llm.engine.executor.model_runner.model
        assert model.prefill_bf16 == (pa == "bf16")
        what = ("bf16 SDPA" if not model.extend_native else
                "extend op, bf16 products" if model.attention.extend_bf16 else "extend op, fp32")
        results[f"tandem int8, bf16 KV, whole-document prefill chunks, prefill_act={pa}, "
                f"prefill_attention={attn} ({what})"] = summary([teacher_forced_logprobs(llm, d) for d in docs])
        llm.shutdown()
try:
    from llama_cpp import Llama
    llama = Llama(path, logits_all=True, n_ctx=cli.doc_tokens + cli.greedy_tokens + 64, n_threads=cli.threads,
                  n_batch=512, verbose=False)
    outs = []
    for pr in prompts:
        llama.reset()
        got = []
        for t in llama.generate(pr, temp=0, top_k=1, reset=True):
            got.append(t)
            if len(got) == cli.greedy_tokens:
                break
        outs.append(got)
    results["llama.cpp"] = {**summary([llama_cpp_logprobs(llama, d) for d in docs]), "greedy": agreement(outs)}
except ImportError as e:
    results["llama.cpp"] = {"skipped": f"{type(e).__name__}: {e}"}


def cpu_flags() -> list[str]:
    """The vector extensions lscpu would list (the ratios hold for the ISA they ran on)."""
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "flags :")
    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "amx", "fma", "f16c")))


out = {"model": os.path.basename(path), "reference": "tandem kernels_act=fp32 (exact mode)",
       "documents": len(docs), "positions": total, "machine": {**machine_info(cli.threads), "flags": cpu_flags()},
       "results": results}
print(json.dumps(out, indent=1))
with open(cli.out, "w") as f:
    json.dump(out, f, indent=2)
