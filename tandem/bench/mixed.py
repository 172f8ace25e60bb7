"""`tandem bench serve --mixed priority|tenants`: the workload of the scheduling policies (issue 45).

A flood (FLOOD_SHARE of the requests: --input-len / --output-len, one class) and a trickle (the rest: a quarter
of those lengths, the other class or classes), shuffled with the seed, all sent at --request-rate:
- priority: the flood has priority FLOOD_PRIORITY, the trickle 0 (run the server with --scheduling-policy priority
  to see the trickle served first, fcfs for the baseline);
- tenants: the flood is tenant-0's, the trickle is shared by tenant-1..3 (the `user` field; --scheduling-policy
  fair).
Each class gets its own p50 / p99 TTFT and output throughput beside the usual totals.
"""
from __future__ import annotations

import random

import numpy as np

from . import line, rule
from .datasets import BenchRequest, random_requests

MIXES = ("priority", "tenants")
FLOOD_SHARE = 0.8
FLOOD_PRIORITY = 10
TRICKLE_TENANTS = 3


def mixed_requests(kind: str, n: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                   text: bool) -> list[tuple[BenchRequest, str, dict]]:
    """(request, its class, its extra body fields) for n >= 2 requests, shuffled with the seed."""
    if n < 2:
        raise ValueError(f"--mixed needs --num-prompts >= 2 (a flood and a trickle), got {n}")
    n_short = max(1, round(n * (1 - FLOOD_SHARE)))
    flood = random_requests(n - n_short, input_len, output_len, vocab_size, 0.0, seed, text)
    short = random_requests(n_short, max(1, input_len // 4), max(1, output_len // 4), vocab_size, 0.0, seed + 1,
                            text)
    if kind == "priority":
        out = [(r, "low-priority flood", {"priority": FLOOD_PRIORITY}) for r in flood] + \
              [(r, "high-priority trickle", {"priority": 0}) for r in short]
    else:
        out = [(r, "tenant-0 flood", {"user": "tenant-0"}) for r in flood] + \
              [(r, f"tenant-{1 + i % TRICKLE_TENANTS}", {"user": f"tenant-{1 + i % TRICKLE_TENANTS}"})
               for i, r in enumerate(short)]
    random.Random(seed).shuffle(out)
    return out


def class_metrics(classes: list[str], results: list, duration: float) -> dict:
    """class -> completed, failed, p50 / p99 TTFT (ms) and output tokens per second over the whole run."""
    out = {}
    for cls in dict.fromkeys(classes):
        mine = [r for c, r in zip(classes, results) if c == cls]
        ok = [r for r in mine if r.success]
        ttft = np.asarray([r.ttft for r in ok], dtype=np.float64) * 1e3
        out[cls] = {"completed": len(ok), "failed": len(mine) - len(ok),
                    "p50_ttft_ms": float(np.median(ttft)) if ttft.size else 0.0,
                    "p99_ttft_ms": float(np.percentile(ttft, 99)) if ttft.size else 0.0,
                    "output_throughput": sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0}
    return out


def print_classes(per: dict) -> None:
    for cls, m in sorted(per.items()):
        rule(f"Class: {cls}", "-")
        line("Successful / failed requests:", f"{m['completed']} / {m['failed']}")
        line("P50 TTFT (ms):", m["p50_ttft_ms"], ".2f")
        line("P99 TTFT (ms):", m["p99_ttft_ms"], ".2f")
        line("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    rule()
