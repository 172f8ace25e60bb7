"""`tandem bench offline`: seeded random prompts through LLM.generate (ignore_eos), like
sglang.bench_offline_throughput: requests/s, input, output and total tokens/s.
"""
from __future__ import annotations

import dataclasses
import time

from ..sampling_params import SamplingParams
from . import engine_threads, line, machine_info, rule
from .datasets import BenchRequest, random_requests

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


def run_offline(llm, requests: list[BenchRequest]) -> dict:
    wall, n_in, n_out = timed_generate(llm, requests)
    n = len(requests)
    return {
        "model": llm.engine.model_name, "scheduler": llm.engine.config.scheduler, "num_prompts": n,
        "successful_requests": n, "duration_s": wall, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": n / wall, "input_throughput": n_in / wall, "output_throughput": n_out / wall,
        "total_throughput": (n_in + n_out) / wall,
    }


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
    rule()


def bench_offline(args) -> dict:
    from ..cli import engine_config
    from ..llm import LLM
    config = engine_config(args)
    llm = LLM(**dataclasses.asdict(config))
    try:
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len,
                               llm.engine.model_config.vocab_size, args.range_ratio, args.seed)
        warm_up(llm)
        result = run_offline(llm, reqs)
    finally:
        llm.shutdown()
    result.update(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed,
                  engine_config=dataclasses.asdict(config), machine=machine_info(engine_threads(config)))
    print_offline(result)
    return result
