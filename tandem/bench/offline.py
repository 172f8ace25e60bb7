"""`tandem bench offline`: seeded prompts through LLM.generate (ignore_eos), like
sglang.bench_offline_throughput: requests/s, input, output and total tokens/s.

Datasets: random (vllm's), shared-prefix (one --prefix-len prefix + --input-len own tokens), long (prompts
of --min-len to --max-len tokens) and multi-turn (--turns rounds; each resends the history with the answers).
"""
from __future__ import annotations

import dataclasses
import time

from ..sampling_params import SamplingParams
from . import engine_threads, line, machine_info, rule
from .datasets import (BenchRequest, long_requests, multi_turn_messages, random_requests,
                       shared_prefix_requests)

DATASETS = ("random", "shared-prefix", "long", "multi-turn")

RESULT_KEYS = ("model", "scheduler", "num_prompts", "successful_requests", "duration_s", "total_input_tokens",
               "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
               "total_throughput")


def params_for(requests: list[BenchRequest]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]


def warm_up(llm) -> None:
    """Two short requests through each loop: first-forward costs stay out of the timed run."""
    vocab = llm.engine.model_config.vocab_size
    reqs = random_requests(2, 8, 2, vocab, seed=12345)
    loop = llm.engine.config.scheduler
    for name in ("serial", "overlap"):
        llm.engine.config = llm.engine.config.replace(scheduler=name)
        llm.generate([r.prompt for r in reqs], params_for(reqs), use_tqdm=False)
    llm.engine.config = llm.engine.config.replace(scheduler=loop)


def timed_generate(llm, requests: list[BenchRequest], scheduler: str | None = None) -> tuple[float, int, int]:
    """(wall seconds, input tokens, output tokens) of one generate call over `requests`."""
    if scheduler is not None:
        llm.engine.config = llm.engine.config.replace(scheduler=scheduler)
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params_for(requests), use_tqdm=False)
    wall = time.perf_counter() - t
    return wall, sum(len(o.prompt_token_ids) for o in outs), sum(len(o.token_ids) for o in outs)


def timed_multi_turn(llm, convs: list[list[list[int]]], output_len: int) -> tuple[float, int, int, int]:
    """Every conversation's turns in order, all conversations at once per turn: (wall s, input tokens,
    output tokens, requests)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    history: list[list[int]] = [[] for _ in convs]
    wall = 0.0
    n_in = n_out = n = 0
    for turn in range(len(convs[0])):
        prompts = [h + c[turn] for h, c in zip(history, convs)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall += time.perf_counter() - t
        history = [p + o.token_ids for p, o in zip(prompts, outs)]
        n_in += sum(len(p) for p in prompts)
        n_out += sum(len(o.token_ids) for o in outs)
        n += len(prompts)
    return wall, n_in, n_out, n


def run_offline(llm, requests: list[BenchRequest] | None, convs: list[list[list[int]]] | None = None,
                output_len: int = 0) -> dict:
    before = _cache_stats(llm)
    if convs is not None:
        wall, n_in, n_out, n = timed_multi_turn(llm, convs, output_len)
    else:
        wall, n_in, n_out = timed_generate(llm, requests)
        n = len(requests)
    return {
        "model": llm.engine.model_name, "scheduler": llm.engine.config.scheduler, "num_prompts": n,
        "successful_requests": n, "duration_s": wall, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": n / wall, "input_throughput": n_in / wall, "output_throughput": n_out / wall,
        "total_throughput": (n_in + n_out) / wall, **_cache_stats(llm, before),
    }


def _cache_stats(llm, before: dict | None = None) -> dict:
    """Prefix cache queries and hits in tokens (of this run, when `before` is given) and their ratio."""
    s = llm.stats()
    q = s.get("prefix_cache_queries", 0) - (before or {}).get("prefix_cache_queries", 0)
    h = s.get("prefix_cache_hits", 0) - (before or {}).get("prefix_cache_hits", 0)
    return {"prefix_cache_queries": q, "prefix_cache_hits": h, "prefix_cache_hit_rate": h / q if q else 0.0}


def print_offline(r: dict) -> None:
    rule("Offline Throughput Benchmark Result")
    line("Backend:", f"tandem ({r['scheduler']})")
    line("Successful requests:", r["successful_requests"])
    line("Benchmark duration (s):", r["duration_s"], ".2f")
    line("Total input tokens:", r["total_input_tokens"])
    line("Total generated tokens:", r["total_output_tokens"])
    line("Request throughput (req/s):", r["request_throughput"], ".2f")
    line("Input token throughput (tok/s):", r["input_throughput"], ".2f")
    line("Output token throughput (tok/s):", r["output_throughput"], ".2f")
    line("Total token throughput (tok/s):", r["total_throughput"], ".2f")
    line("Prefix cache hit rate:", r.get("prefix_cache_hit_rate", 0.0), ".3f")
    rule()


def bench_offline(args) -> dict:
    from ..cli import engine_config
    from ..llm import LLM
    config = engine_config(args)
    llm = LLM(**dataclasses.asdict(config))
    try:
        vocab = llm.engine.model_config.vocab_size
        reqs, convs = None, None
        dataset = getattr(args, "dataset", "random")
        if dataset == "shared-prefix":
            reqs = shared_prefix_requests(args.num_prompts, args.prefix_len, args.input_len, args.output_len, vocab,
                                          args.seed)
        elif dataset == "long":
            reqs = long_requests(args.num_prompts, args.output_len, vocab, args.min_len, args.max_len, args.seed)
        elif dataset == "multi-turn":
            convs = multi_turn_messages(args.num_prompts, args.turns, args.input_len, vocab, args.seed)
        else:
            reqs = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.range_ratio,
                                   args.seed)
        warm_up(llm)
        result = run_offline(llm, reqs, convs, args.output_len)
        result["dataset"] = dataset
    finally:
        llm.shutdown()
    result.update(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed,
                  engine_config=dataclasses.asdict(config), machine=machine_info(engine_threads(config)))
    print_offline(result)
    return result
