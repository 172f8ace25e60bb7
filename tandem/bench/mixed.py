"""`tandem bench serve --mixed priority|tenants|backlog`: the workload of the scheduling policies (issue 45).

A flood (FLOOD_SHARE of the requests: --input-len / --output-len, one class) and a trickle (the rest: a quarter
of those lengths, the other class or classes), shuffled with the seed, all sent at --request-rate:
- priority: the flood has priority FLOOD_PRIORITY, the trickle 0 (run the server with --scheduling-policy priority
  to see the trickle served first, fcfs for the baseline);
- tenants: the flood is tenant-0's, the trickle is shared by tenant-1..3 (the `user` field; --scheduling-policy
  fair).
- backlog: every request the same length (--input-len / --output-len), BACKLOG_FLOOD of them tenant-0's and the
  rest shared by tenant-1..3, so that (sent at once) every tenant has more waiting than it is served: the shares
  of a fair scheduler show. Each tenant's `backlog_share` is its part of the output tokens streamed while every
  tenant still had requests in flight (up to the first tenant's last token): fcfs gives the flood about its part
  of the requests, fair (equal weights) a quarter each.
Each class gets its own p50 / p99 TTFT and output throughput beside the usual totals.
"""
from __future__ import annotations

import random

import numpy as np

from . import line, rule
from .datasets import BenchRequest, random_requests

MIXES = ("priority", "tenants", "backlog")
FLOOD_SHARE = 0.8
BACKLOG_FLOOD = 0.5
FLOOD_PRIORITY = 10
TRICKLE_TENANTS = 3


def mixed_requests(kind: str, n: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                   text: bool) -> list[tuple[BenchRequest, str, dict]]:
    """(request, its class, its extra body fields) for n >= 2 requests, shuffled with the seed."""
    if n < 2:
        raise ValueError(f"--mixed needs --num-prompts >= 2 (a flood and a trickle), got {n}")
    if kind == "backlog":
        reqs = random_requests(n, input_len, output_len, vocab_size, 0.0, seed, text)
        n_flood = max(1, round(n * BACKLOG_FLOOD))
        flood, short = reqs[:n_flood], reqs[n_flood:]
    else:
        n_short = max(1, round(n * (1 - FLOOD_SHARE)))
        flood = random_requests(n - n_short, input_len, output_len, vocab_size, 0.0, seed, text)
        short = random_requests(n_short, max(1, input_len // 4), max(1, output_len // 4), vocab_size, 0.0,
                                seed + 1, text)
    if kind == "priority":
        out = [(r, "low-priority flood", {"priority": FLOOD_PRIORITY}) for r in flood] + \
              [(r, "high-priority trickle", {"priority": 0}) for r in short]
    else:                                         # tenants, backlog: the flood tenant-0's, the rest shared
        out = [(r, "tenant-0 flood", {"user": "tenant-0"}) for r in flood] + \
              [(r, f"tenant-{1 + i % TRICKLE_TENANTS}", {"user": f"tenant-{1 + i % TRICKLE_TENANTS}"})
               for i, r in enumerate(short)]
    random.Random(seed).shuffle(out)
    return out


def class_metrics(classes: list[str], results: list, duration: float) -> dict:
    """class -> completed, failed, p50 / p99 TTFT (ms) and output tokens per second over the whole run."""
    out = {}
    shares = backlog_shares(classes, results)
    for cls in dict.fromkeys(classes):
        mine = [r for c, r in zip(classes, results) if c == cls]
        ok = [r for r in mine if r.success]
        ttft = np.asarray([r.ttft for r in ok], dtype=np.float64) * 1e3
        out[cls] = {"completed": len(ok), "failed": len(mine) - len(ok),
                    "p50_ttft_ms": float(np.median(ttft)) if ttft.size else 0.0,
                    "p99_ttft_ms": float(np.percentile(ttft, 99)) if ttft.size else 0.0,
                    "output_throughput": sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0,
                    "backlog_share": shares.get(cls, 0.0)}
    return out


def token_times(r) -> list[float]:
    """When each output token of a finished request arrived (perf_counter), a chunk's tokens at its time."""
    chunks = [r.sent + r.ttft]
    for gap in r.itl:
        chunks.append(chunks[-1] + gap)
    per = r.output_tokens / len(chunks)
    return [t for i, t in enumerate(chunks) for _ in range(round(per * (i + 1)) - round(per * i))]


def backlog_shares(classes: list[str], results: list) -> dict[str, float]:
    """class -> its part of the output tokens streamed while every class still had a request unfinished (up to
    the earliest of the classes' last tokens); {} when a class has no finished request."""
    ends = {}
    for c, r in zip(classes, results):
        if r.success:
            ends[c] = max(ends.get(c, 0.0), r.sent + r.latency)
    if set(ends) != set(classes):
        return {}
    window = min(ends.values())
    counts = dict.fromkeys(ends, 0)
    for c, r in zip(classes, results):
        if r.success and r.output_tokens:
            counts[c] += sum(t <= window for t in token_times(r))
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items()} if total else {}


def print_classes(per: dict) -> None:
    for cls, m in sorted(per.items()):
        rule(f"Class: {cls}", "-")
        line("Successful / failed requests:", f"{m['completed']} / {m['failed']}")
        line("P50 TTFT (ms):", m["p50_ttft_ms"], ".2f")
        line("P99 TTFT (ms):", m["p99_ttft_ms"], ".2f")
        line("Output token throughput (tok/s):", m["output_throughput"], ".2f")
        line("Share of tokens while all backlogged:", m["backlog_share"], ".3f")
    rule()
