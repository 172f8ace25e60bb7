"""`tandem bench soak`: a bounded chaos run against an OpenAI-compatible server.

A seeded mix of valid completions and chats (streamed or not, greedy or sampled), clients that disconnect
mid-stream or give up early, hostile inputs that must be refused with a 4xx, and requests that a fault
injected into the engine fails (TANDEM_INJECT_FAULT, tandem/faults.py). Every answer is checked against
what its kind allows; anything else is listed in `unexpected`. The test suite runs a short version
(tests/server/test_chaos.py); the bench runs a long one and reports memory before and after.

  tandem bench soak --requests 3000 --concurrency 32 --json soak.json
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from dataclasses import dataclass

from . import line, rule

FAULT_IDS = (7, 7, 7, 7, 7)      # prompts starting with these token ids hit the injected fault
OVERSIZED_BYTES = 8 << 20        # above every default --max-request-bytes up to a 224k-token context
PROMPT_IDS_BELOW = 32000         # random prompt ids: valid in every supported vocabulary
BEYOND_VOCAB = 10 ** 7           # a token id / top_k past every vocabulary (but within int64)

# Kinds and their weights in the mix (the fault kind is added only when the server injects one); the last five
# are the other routes': /v1/responses, /v1/messages (whole, or streamed and maybe left), /tokenize + /detokenize,
# /v1/embeddings (a batch of inputs, or given up on: an abort).
MIX = {"completion": 30, "chat": 15, "stream": 20, "disconnect": 10, "give_up": 5, "bad": 20,
       "responses": 5, "messages": 5, "route_stream": 8, "tokenize": 4, "embeddings": 5}
ROUTE_KINDS = ("responses", "messages", "route_stream", "tokenize", "embeddings")
ROUTE_PATHS = ("/v1/responses", "/v1/messages", "/v1/embeddings")    # routes whose bodies name the model


def _bad_bodies(model: str) -> list[tuple[str, str, str]]:
    """(name, path, raw JSON body) of requests a server must refuse with a 4xx, and never crash on; the other
    routes' bodies name the served model, so each is refused for the field it targets."""
    ok = {"prompt": "hello", "max_tokens": 2}
    msgs = [{"role": "user", "content": "hi"}]
    s = "\ud800"                  # a lone surrogate: valid JSON (as an escape), not valid Unicode text
    cases = {
        "top_k_int64": ("/v1/completions", {**ok, "top_k": 2 ** 63}),
        "top_k_uint64": ("/v1/completions", {**ok, "top_k": 2 ** 64 + 1}),
        "top_k_vocab": ("/v1/completions", {**ok, "top_k": BEYOND_VOCAB}),
        "temperature_negative": ("/v1/completions", {**ok, "temperature": -1}),
        "temperature_inf": ("/v1/completions", {**ok, "temperature": float("inf")}),
        "top_p_nan": ("/v1/completions", {**ok, "top_p": float("nan")}),
        "max_tokens_huge": ("/v1/completions", {**ok, "max_tokens": 10 ** 30}),
        "seed_huge": ("/v1/completions", {**ok, "seed": 2 ** 70}),
        "n_0": ("/v1/completions", {**ok, "n": 0}),
        "n_huge": ("/v1/completions", {**ok, "n": 10 ** 6}),
        "best_of_not_n": ("/v1/completions", {**ok, "n": 2, "best_of": 3}),
        "unknown_field": ("/v1/completions", {**ok, "no_such_field": 1}),
        "bad_schema": ("/v1/completions", {**ok, "response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": {"type": "nonsense"}}}}),
        "bad_regex": ("/v1/completions", {**ok, "structured_outputs": {"regex": "[a-z"}}),
        "surrogate_prompt": ("/v1/completions", {**ok, "prompt": "hi" + s}),
        "surrogate_stop": ("/v1/completions", {**ok, "stop": [s]}),
        "surrogate_model": ("/v1/completions", {**ok, "model": s}),
        "surrogate_content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": s}]}),
        "surrogate_role": ("/v1/chat/completions", {"messages": [{"role": s, "content": "hi"}]}),
        "unknown_model": ("/v1/completions", {**ok, "model": "no-such-model"}),
        "unknown_role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
        "missing_role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
        "stream_options_alone": ("/v1/completions", {**ok, "stream_options": {"include_usage": True}}),
        "token_out_of_vocab": ("/v1/completions", {**ok, "prompt": [1, BEYOND_VOCAB]}),
        "too_many_messages": ("/v1/chat/completions", {"messages": msgs * 5000}),
        "empty_prompt": ("/v1/completions", {**ok, "prompt": ""}),
        "responses_stateful": ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}),
        "responses_item": ("/v1/responses", {"input": [{"type": "input_image", "image_url": "x"}]}),
        "responses_surrogate": ("/v1/responses", {"input": s}),
        "messages_no_max": ("/v1/messages", {"messages": msgs}),
        "messages_image": ("/v1/messages", {"max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]}),
        "messages_huge_max": ("/v1/messages", {"max_tokens": 10 ** 30, "messages": msgs}),
        "tokenize_both": ("/tokenize", {"prompt": "a", "messages": msgs}),
        "detokenize_vocab": ("/detokenize", {"tokens": [BEYOND_VOCAB]}),
        "embeddings_dimensions": ("/v1/embeddings", {"input": "hi", "dimensions": 8}),
        "embeddings_pooling": ("/v1/embeddings", {"input": "hi", "pooling": "max"}),
        "embeddings_empty": ("/v1/embeddings", {"input": []}),
        "embeddings_vocab": ("/v1/embeddings", {"input": [[1, 2], [BEYOND_VOCAB]]}),
        "embeddings_surrogate": ("/v1/embeddings", {"input": ["a", s]}),
    }
    out = [(name, path, json.dumps({"model": model, **body} if path in ROUTE_PATHS else body))
           for name, (path, body) in cases.items()]
    out.append(("malformed_json", "/v1/completions", '{"prompt": "a", '))
    out.append(("oversized_body", "/v1/completions",
                json.dumps({**ok, "prompt": "x" * OVERSIZED_BYTES})))
    return out


@dataclass
class Outcome:
    kind: str
    status: int | None          # HTTP status (None: the client left before an answer)
    problem: str | None         # why this outcome is not what its kind allows; None if it is


async def _one(http, rng: random.Random, kind: str, bad: list, model: str) -> Outcome:
    import httpx
    greedy = rng.random() < 0.5
    sampling = {"max_tokens": rng.randint(1, 16), "temperature": 0.0 if greedy else rng.choice([0.7, 1.0, 1e-38]),
                "seed": rng.randrange(1 << 30), "model": model}
    prompt = [rng.randrange(100, PROMPT_IDS_BELOW) for _ in range(rng.randint(1, 40))]
    if kind in ROUTE_KINDS:
        return await _route(http, rng, kind, sampling, " ".join(str(t) for t in prompt))
    if kind == "bad":
        name, path, body = rng.choice(bad)
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
        ok = r.status_code in (400, 404, 413) and "error" in r.json()
        return Outcome(f"bad:{name}", r.status_code, None if ok else f"{name}: {r.status_code} {r.text[:200]}")
    if kind == "fault":
        r = await http.post("/v1/completions", json={**sampling, "prompt": list(FAULT_IDS) + prompt})
        ok = r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        return Outcome(kind, r.status_code, None if ok else f"fault: {r.status_code} {r.text[:200]}")
    if kind == "chat":
        r = await http.post("/v1/chat/completions", json={
            **sampling, "messages": [{"role": "user", "content": " ".join(str(t) for t in prompt)}]})
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        return Outcome(kind, r.status_code, None if ok else f"chat: {r.status_code} {r.text[:200]}")
    if kind == "completion":
        r = await http.post("/v1/completions", json={**sampling, "prompt": prompt})
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        return Outcome(kind, r.status_code, None if ok else f"completion: {r.status_code} {r.text[:200]}")
    if kind == "give_up":          # a client that stops waiting: the server aborts the request
        try:
            r = await http.post("/v1/completions", json={**sampling, "prompt": prompt, "max_tokens": 64,
                                                         "ignore_eos": True}, timeout=rng.uniform(0.001, 0.05))
            return Outcome(kind, r.status_code, None if r.status_code == 200 else f"give_up: {r.status_code}")
        except httpx.TimeoutException:
            return Outcome(kind, None, None)
    # stream / disconnect: read the SSE stream, all of it or a few events
    leave_after = rng.randint(1, 3) if kind == "disconnect" else None
    body = {**sampling, "prompt": prompt, "stream": True}
    if kind == "disconnect":
        body.update(max_tokens=64, ignore_eos=True)
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Outcome(kind, r.status_code, f"{kind}: {r.status_code}")
        events = 0
        async for raw in r.aiter_lines():
            if not raw.startswith("data: "):
                continue
            data = raw[6:]
            if data == "[DONE]":
                return Outcome(kind, 200, None if events else f"{kind}: no event before [DONE]")
            if "error" in json.loads(data):
                return Outcome(kind, 200, f"{kind}: error event {data[:200]}")
            events += 1
            if leave_after is not None and events >= leave_after:
                return Outcome(kind, 200, None)          # leaving closes the connection: an abort
    return Outcome(kind, 200, f"{kind}: stream ended without [DONE]")


async def _route(http, rng: random.Random, kind: str, sampling: dict, text: str) -> Outcome:
    """A valid request to /v1/responses, /v1/messages or /tokenize + /detokenize, answered in its route's shape;
    a route stream is read to its last event or left after a few (an abort)."""
    model, temp = sampling["model"], sampling["temperature"]
    if kind == "tokenize":
        r = await http.post("/tokenize", json={"model": model, "prompt": text})
        ok = r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) >= 1
        if ok:
            r = await http.post("/detokenize", json={"model": model, "tokens": r.json()["tokens"]})
            ok = r.status_code == 200 and isinstance(r.json()["prompt"], str)
        return Outcome(kind, r.status_code, None if ok else f"tokenize: {r.status_code} {r.text[:200]}")
    if kind == "embeddings":
        return await _embeddings(http, rng, model, text)
    path = "/v1/messages" if kind == "messages" or (kind == "route_stream" and rng.random() < 0.5) \
        else "/v1/responses"
    body = {"model": model, "max_tokens": sampling["max_tokens"], "temperature": temp,
            "messages": [{"role": "user", "content": text}]} if path == "/v1/messages" else \
        {"model": model, "max_output_tokens": sampling["max_tokens"], "temperature": temp, "input": text,
         "seed": sampling["seed"]}
    if kind != "route_stream":
        r = await http.post(path, json=body)
        ok = r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
        return Outcome(kind, r.status_code, None if ok else f"{kind}: {r.status_code} {r.text[:200]}")
    leave_after = rng.choice([None, rng.randint(1, 4)])
    last = ("message_stop",) if path == "/v1/messages" else ("response.completed", "response.incomplete")
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return Outcome(kind, r.status_code, f"{kind} {path}: {r.status_code}")
        events = 0
        async for raw in r.aiter_lines():
            if not raw.startswith("data: "):
                continue
            event = json.loads(raw[6:])["type"]
            if event in ("error", "response.failed"):
                return Outcome(kind, 200, f"{kind} {path}: error event {raw[:200]}")
            events += 1
            if event in last:
                return Outcome(kind, 200, None)
            if leave_after is not None and events >= leave_after:
                return Outcome(kind, 200, None)          # leaving closes the connection: an abort
    return Outcome(kind, 200, f"{kind} {path}: stream ended without its last event")


async def _embeddings(http, rng: random.Random, model: str, text: str) -> Outcome:
    """A batch of 1-4 inputs (text or ids) to /v1/embeddings: one unit vector per input; or a client that gives up
    before the answer (its requests are aborted)."""
    import httpx
    inputs = [text[:rng.randint(1, len(text))] for _ in range(rng.randint(1, 4))]
    body = {"model": model, "input": inputs, "encoding_format": rng.choice(["float", "base64"])}
    try:
        r = await http.post("/v1/embeddings", json=body, timeout=rng.choice([120.0, rng.uniform(0.001, 0.05)]))
    except httpx.TimeoutException:
        return Outcome("embeddings", None, None)
    ok = r.status_code == 200 and [d["index"] for d in r.json()["data"]] == list(range(len(inputs)))
    if ok and body["encoding_format"] == "float":
        ok = all(abs(sum(x * x for x in d["embedding"]) - 1) < 1e-4 for d in r.json()["data"])
    return Outcome("embeddings", r.status_code, None if ok else f"embeddings: {r.status_code} {r.text[:200]}")


def rss_mb(pids: list[int]) -> float:
    """Resident memory of these processes, MiB (0 for those gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


async def run_soak(base_url: str, requests: int, concurrency: int, seed: int = 0, fault: bool = False,
                   timeout_s: float = 120.0) -> dict:
    """Send `requests` requests of the mix, `concurrency` at a time; one in ~100 is a fault request when
    `fault` (the server runs with TANDEM_INJECT_FAULT=process:FAULT_IDS). Returns the summary."""
    import httpx
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, trust_env=False) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        bad = _bad_bodies(model)
        mix = dict(MIX, **({"fault": 1} if fault else {}))
        kinds = rng.choices(list(mix), weights=list(mix.values()), k=requests)
        if fault and "fault" not in kinds:
            kinds[rng.randrange(requests)] = "fault"
        seeds = [rng.randrange(1 << 30) for _ in kinds]
        sem = asyncio.Semaphore(concurrency)

        async def guarded(kind: str, s: int) -> Outcome:
            async with sem:
                try:
                    return await _one(http, random.Random(s), kind, bad, model)
                except Exception as e:            # a transport error is an outcome too, never a crash
                    return Outcome(kind, None, f"{kind}: {type(e).__name__}: {e}")
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(guarded(k, s) for k, s in zip(kinds, seeds)))
        elapsed = time.perf_counter() - start
    statuses = collections.Counter(str(o.status) for o in outcomes)
    by_kind = collections.Counter(o.kind.split(":")[0] for o in outcomes)
    return {"requests": requests, "concurrency": concurrency, "seed": seed, "seconds": round(elapsed, 2),
            "kinds": dict(by_kind), "statuses": dict(statuses),
            "unexpected": [o.problem for o in outcomes if o.problem is not None]}


def _start_server(args, env: dict) -> tuple:
    """`tandem serve` on a free loopback port with the fault injected; returns (process, base_url)."""
    import socket
    import subprocess
    import sys

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def bench_soak(args) -> dict:
    import httpx

    from . import machine_info
    env = dict(os.environ, TANDEM_INJECT_FAULT="process:" + ",".join(map(str, FAULT_IDS)))
    proc, url = _start_server(args, env)
    try:
        pids = _tree(proc.pid)               # frontend, engine process, device process
        names = ("frontend", "engine", "device")[:len(pids)]
        before = {n: round(rss_mb([p]), 1) for n, p in zip(names, pids)}
        result = asyncio.run(run_soak(url, args.requests, args.concurrency, args.seed, True))
        metrics = httpx.get(url + "/metrics", trust_env=False).text
        after = {n: round(rss_mb([p]), 1) for n, p in zip(names, pids)}
        healthy = httpx.get(url + "/health", trust_env=False).status_code
    finally:
        proc.terminate()
        proc.wait(60)
    gauges = {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in metrics.splitlines()
                                       if ln.startswith(("tandem:num_requests", "tandem:kv_cache_usage",
                                                         "tandem:frontend_open")))}
    result.update(rss_mb_before=before, rss_mb_after=after, health_after=healthy,
                  gauges_after=gauges, machine=machine_info())
    rule("Soak Result")
    for key in ("requests", "concurrency", "seconds", "kinds", "statuses", "rss_mb_before", "rss_mb_after",
                "health_after", "gauges_after"):
        line(key + ":", str(result[key]))
    line("Unexpected outcomes:", len(result["unexpected"]))
    for p in result["unexpected"][:10]:
        print("  " + p)
    return result
