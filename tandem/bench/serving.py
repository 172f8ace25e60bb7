"""`tandem bench serve`: an async client of any OpenAI-compatible server, with the metrics of `vllm bench serve`.

Each request streams /v1/completions (prompt as token ids or text, ignore_eos, max_tokens). Per request:
TTFT (first chunk with text), ITL (gaps between such chunks), E2EL (until the stream ends), and TPOT =
(E2EL - TTFT) / (output tokens - 1). Output tokens come from `usage` when the server sends it, else one per
text chunk. A request that fails (HTTP error, connection error, error event, no `data: [DONE]`) is counted
in `failed` with its reason in `errors`; it never stops the run.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from . import line, rule
from .datasets import BenchRequest

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                                     # seconds from send to the first text chunk
    latency: float = 0.0                                  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)        # seconds between consecutive text chunks
    sent: float = 0.0                                     # perf_counter() when it was sent
    error: str = ""


async def request_completion(session, url: str, model: str | None, req: BenchRequest,
                             fields: dict | None = None) -> RequestResult:
    """One streamed request; `fields`: extra body fields (the mixed workload's priority or user)."""
    import aiohttp
    payload = {"prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True, **(fields or {})}
    if model:
        payload["model"] = model
    out = RequestResult(prompt_len=req.prompt_len)
    chunks, usage, done = 0, None, False
    start = last = out.sent = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for raw in resp.content:                # one SSE line at a time
                text = raw.strip()
                if not text.startswith(b"data:"):
                    continue
                data = text[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if obj.get("error"):
                    out.error = f"error event: {obj['error']}"[:300]
                    return out
                usage = obj.get("usage") or usage
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.latency = time.perf_counter() - start
    if not done:
        out.error = "the stream ended before data: [DONE]"
        return out
    if usage:
        out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
    else:
        out.output_tokens = chunks
    if chunks == 0:
        out.ttft = out.latency
    out.success = True
    return out


async def served_model(session, base_url: str) -> str | None:
    """The first id of GET /v1/models, or None (then requests name no model)."""
    try:
        async with session.get(base_url + "/v1/models") as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                return data[0]["id"] if data else None
    except Exception:               # no /v1/models (or not JSON): send no model name
        return None
    return None


async def run_requests(base_url: str, model: str | None, requests: list[BenchRequest], request_rate: float,
                       max_concurrency: int | None, seed: int, warmup: int, fields: list[dict] | None = None):
    """Send the requests (Poisson arrivals at request_rate, at most max_concurrency in flight), each with its
    `fields` (extra body fields) where given.
    Returns (results in request order, duration in s, the model name sent)."""
    import aiohttp
    base_url = base_url.rstrip("/")
    url = base_url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        if model is None:
            model = await served_model(session, base_url)
        for _ in range(warmup):           # not counted; a failure here is reported, not fatal
            r = await request_completion(session, url, model, requests[0])
            if not r.success:
                print(f"warm-up request failed: {r.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(req: BenchRequest, extra: dict) -> RequestResult:
            if sem is None:
                return await request_completion(session, url, model, req, extra)
            async with sem:
                return await request_completion(session, url, model, req, extra)

        rng = random.Random(seed)
        tasks = []
        start = time.perf_counter()
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(limited(req, fields[i] if fields else {})))
            if not math.isinf(request_rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    values = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    m = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": n_in, "total_output_tokens": n_out,
         "request_throughput": len(ok) / duration if duration > 0 else 0.0,
         "output_throughput": n_out / duration if duration > 0 else 0.0,
         "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0}
    for name in METRICS:
        m.update(_stats(name, values[name]))
    m.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
             ttfts=[r.ttft for r in results], itls=[r.itl for r in results], errors=[r.error for r in results])
    return m


def print_serving(m: dict) -> None:
    rule("Serving Benchmark Result")
    line("Successful requests:", m["completed"])
    line("Failed requests:", m["failed"])
    if m.get("max_concurrency"):
        line("Maximum request concurrency:", m["max_concurrency"])
    line("Benchmark duration (s):", m["duration"], ".2f")
    line("Total input tokens:", m["total_input_tokens"])
    line("Total generated tokens:", m["total_output_tokens"])
    line("Request throughput (req/s):", m["request_throughput"], ".2f")
    line("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    line("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for name in METRICS:
        rule(METRIC_TITLES[name], "-")
        for stat in ("Mean", "Median", "P99"):
            line(f"{stat} {name.upper()} (ms):", m[f"{stat.lower()}_{name}_ms"], ".2f")
    rule()


def _workload(args) -> tuple[list, list | None, list | None]:
    """The requests of `bench serve`, their classes (--mixed) and extra body fields (--mixed, --agents)."""
    from .datasets import random_requests
    classes, fields = None, None
    if args.agents and args.mixed:
        raise ValueError("--agents and --mixed are two workloads: give one")
    if args.agents:
        from .datasets import agent_requests
        if args.agents < 1 or args.system_len < 1:
            raise ValueError(f"--agents and --system-len must be >= 1, got {args.agents} and {args.system_len}")
        if args.prompt_type == "text":
            raise ValueError("--agents sends token ids: --prompt-type text is not supported with it")
        pairs = agent_requests(args.num_prompts, args.agents, args.system_len, args.input_len, args.output_len,
                               args.vocab_size, args.seed)
        return [r for r, _ in pairs], None, [{"user": f"tenant-{t}"} for _, t in pairs]
    if args.mixed:
        from .mixed import mixed_requests
        reqs, classes, fields = map(list, zip(*mixed_requests(args.mixed, args.num_prompts, args.input_len,
                                                              args.output_len, args.vocab_size, args.seed,
                                                              args.prompt_type == "text")))
        return reqs, classes, fields
    return (random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.range_ratio,
                            args.seed, text=args.prompt_type == "text"), classes, fields)


def bench_serve(args) -> dict:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    reqs, classes, fields = _workload(args)
    print(f"Traffic request rate: {args.request_rate}\nMaximum request concurrency: {args.max_concurrency}")
    results, duration, model = asyncio.run(run_requests(args.base_url, args.model, reqs, args.request_rate,
                                                        args.max_concurrency, args.seed, args.warmup_requests,
                                                        fields))
    m = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": args.base_url,
         "model_id": model, "num_prompts": args.num_prompts,
         "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
         "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
         "range_ratio": args.range_ratio, "prompt_type": args.prompt_type, "seed": args.seed,
         "mixed": args.mixed, "agents": args.agents, "system_len": args.system_len if args.agents else None,
         **compute_metrics(results, duration)}
    print_serving(m)
    if classes is not None:
        from .mixed import class_metrics, print_classes
        m["classes"] = class_metrics(classes, results, duration)
        print_classes(m["classes"])
    return m
