"""Data parallelism through the server: `tandem serve --dp 2` on the tiny Llama (two engine replicas, one core
each), against the offline engine (DP 1); per-replica metrics; the cache-aware router; a replica killed
mid-run; SIGTERM leaving nothing behind.
"""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from tests.helpers.server_utils import ServerProcess, assert_error, children, process_tree, wait_gone
from tests.helpers.server_utils import runtime_dirs

KV = "8192"
PROMPTS = [f"Request {i}: the quick brown fox" + " jumps over" * (i % 5) for i in range(12)]
SEEDS = [3, 11, 29, 40]
MAX_TOKENS = 10


def start(model_dir, log_dir, *extra) -> ServerProcess:
    return ServerProcess(["--model", model_dir, "--kv-cache-tokens", KV, "--dp", "2", "--served-model-name", "tiny",
                          *extra], str(log_dir / "server.log"))


def replica_pids(srv: ServerProcess) -> dict[int, int]:
    """replica index -> its engine process, told apart by the core each is pinned to (replica i: share i)."""
    engines = sorted(children(srv.proc.pid), key=lambda pid: min(os.sched_getaffinity(pid)))
    assert len(engines) == 2, engines
    return dict(enumerate(engines))


def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST every body at once (one thread each): the router sees them all in flight."""
    out: list = [None] * len(bodies)

    def post(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as h:
            out[i] = h.post("/v1/completions", json=bodies[i])
    threads = [threading.Thread(target=post, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r is not None for r in out), "a request hung"
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from tandem import LLM, SamplingParams
    llm = LLM(tiny_llama, kv_cache_tokens=int(KV), device_threads=1)
    try:
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        seeded = [llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS),
                               use_tqdm=False)[0] for s in SEEDS]
    finally:
        llm.shutdown()
    return [o.text for o in greedy], [o.text for o in seeded]


def test_dp2_equals_dp1_with_per_replica_metrics_and_clean_sigterm(tiny_llama, tmp_path, reference):
    srv = start(tiny_llama, tmp_path)
    try:
        pids = process_tree(srv.proc.pid)
        assert len(pids) == 5, pids            # frontend, two engine processes, two device processes
        bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]
        bodies += [{"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": s} for s in SEEDS]
        out = post_all(srv.url, bodies)
        assert [r.status_code for r in out] == [200] * len(bodies), [r.text for r in out if r.status_code != 200]
        texts = [r.json()["choices"][0]["text"] for r in out]
        assert texts == reference[0] + reference[1]

        # Both replicas served (least-load spreads requests in flight at once); the unlabelled series is the sum.
        m = srv.metrics()
        per = [srv.wait_metric(f'tandem:prefix_cache_queries_total{{model_name="tiny",replica="{i}"}}',
                               lambda v: v > 0) for i in (0, 1)]
        assert m['tandem:prefix_cache_queries_total{model_name="tiny"}'] == sum(per)
        assert m['tandem:replica_up{model_name="tiny",replica="0"}'] == 1.0
        assert m['tandem:replica_up{model_name="tiny",replica="1"}'] == 1.0
        assert m['tandem:num_requests_running{model_name="tiny",replica="1"}'] == 0.0
        assert 'tandem:kv_cache_usage_perc{model_name="tiny"}' in m
        assert m['tandem:generation_tokens_total{model_name="tiny"}'] == sum(
            r.json()["usage"]["completion_tokens"] for r in out)

        # A client that leaves mid-stream aborts its request on whichever replica holds it.
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
            with h.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 400,
                                                           "ignore_eos": True, "stream": True}) as resp:
                next(resp.iter_lines())
        srv.wait_metric('tandem:request_success_total{finished_reason="abort",model_name="tiny"}', lambda v: v == 1)
        srv.wait_metric('tandem:frontend_open_requests{model_name="tiny"}', lambda v: v == 0)

        assert srv.stop(signal.SIGTERM) == 0, srv.log()
        assert wait_gone(pids) == []
        assert runtime_dirs(*pids) == []      # neither replica's shared memory nor the IPC sockets remain
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def test_cache_aware_router_then_a_replica_dies(tiny_llama, tmp_path):
    srv = start(tiny_llama, tmp_path, "--router", "cache-aware", "--no-exit-on-engine-failure")
    try:
        pids = process_tree(srv.proc.pid)
        shared = "You are a helpful assistant who answers in one short sentence. " * 4
        hits = 'tandem:prefix_cache_hits_total{model_name="tiny",replica="%d"}'

        def complete(prompt: str) -> dict:
            r = srv.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()
        complete(shared + "Question one?")          # empty trees: replica 0
        complete("Something else entirely, with no shared start at all.")   # a miss: the smaller tree, replica 1
        again = complete(shared + "Question two?")   # the shared prefix: back to replica 0, whose cache holds it
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        srv.wait_metric(hits % 0, lambda v: v > 0)
        assert srv.metrics()[hits % 1] == 0.0

        # One long request on each replica (their prefixes route them); kill replica 0 mid-run: its request
        # gets 503 at once, the other one finishes, and the server serves on with replica 1.
        long = [{"prompt": prompt + " Tell me a long story.", "max_tokens": 420, "temperature": 0,
                 "ignore_eos": True} for prompt in (shared, "Something else entirely, with no shared start")]
        results: list = []
        runner = threading.Thread(target=lambda: results.extend(post_all(srv.url, long)), daemon=True)
        runner.start()
        running = 'tandem:num_requests_running{model_name="tiny",replica="%d"}'
        for i in (0, 1):
            srv.wait_metric(running % i, lambda v: v == 1)
        victim = process_tree(replica_pids(srv)[0])           # its engine and device processes
        os.kill(victim[0], signal.SIGKILL)
        runner.join(180)
        assert not runner.is_alive(), "a request hung after its replica died"
        assert [r.status_code for r in results] == [503, 200], [r.text for r in results]
        assert_error(results[0], 503)
        assert results[1].json()["usage"]["completion_tokens"] == 420
        srv.wait_metric('tandem:replica_up{model_name="tiny",replica="0"}', lambda v: v == 0)
        assert wait_gone(victim) == []
        assert runtime_dirs(*victim) == []                     # the survivor removed its shared memory
        assert srv.http.get("/health").status_code == 200       # the other replica serves on
        assert complete(shared + "Question three?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        assert srv.stop(signal.SIGTERM) == 0, srv.log()
        assert wait_gone(pids) == []
        assert runtime_dirs(*pids) == []
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def test_offline_dp2_equals_dp1(tiny_llama, reference):
    from tandem import LLM, SamplingParams
    before = set(children(os.getpid()))
    llm = LLM(tiny_llama, dp_size=2, router="cache-aware", kv_cache_tokens=int(KV))
    try:
        assert len(set(children(os.getpid())) - before) == 2           # two engine processes
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        seeded = llm.generate([PROMPTS[0]] * len(SEEDS), [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS)
                                                          for s in SEEDS], use_tqdm=False)
        assert [o.text for o in greedy] == reference[0] and [o.text for o in seeded] == reference[1]
        assert llm.stats()["num_running"] == 0
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([[10 ** 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        engines = set(children(os.getpid())) - before
        llm.shutdown()
    assert wait_gone(sorted(engines)) == []
    with pytest.raises(ValueError, match="router must be one of"):
        LLM(tiny_llama, dp_size=2, router="random")
