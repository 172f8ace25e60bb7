"""Server life cycle on a tiny model: SIGTERM mid-stream, a bounded waiting queue, an engine that dies.

Each test starts its own `tandem serve` process and checks that it exits 0 and leaves no process behind.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from server_utils import ServerProcess, assert_error, process_tree, sse_events, wait_gone

LONG = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return tiny_llama


def start(model_dir, tmp_path, *extra) -> ServerProcess:
    return ServerProcess(["--model", model_dir, "--kv-cache-tokens", "8192", "--device-threads", "1", *extra],
                         str(tmp_path / "server.log"))


def test_sigterm_mid_stream_exits_0_and_leaves_no_process(model_dir, tmp_path):
    srv = start(model_dir, tmp_path)
    pids = process_tree(srv.proc.pid)
    assert len(pids) == 3, pids               # frontend, engine process, CPU device process
    lines: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
            with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    first.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(60), srv.log()
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    reader.join(30)
    assert not reader.is_alive()
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"     # ended by the shutdown, not by length
    assert wait_gone(pids) == []


def test_queue_bound_then_engine_death(model_dir, tmp_path):
    srv = start(model_dir, tmp_path, "--scheduler", "serial", "--max-running-requests", "1",
                "--max-waiting-requests", "1")
    try:
        pids = process_tree(srv.proc.pid)
        engine = srv.engine_pid()
        # Freeze the engine so that all four requests are pending when it next polls: one fits the
        # waiting queue, the others must get 503 (not hang, not crash it).
        os.kill(engine, signal.SIGSTOP)
        results: list[httpx.Response] = []

        def post():
            with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as h:
                results.append(h.post("/v1/completions", json={**LONG, "max_tokens": 8}))

        threads = [threading.Thread(target=post, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)                        # let the frontend forward them (not a timing assertion)
        os.kill(engine, signal.SIGCONT)
        for t in threads:
            t.join(120)
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
        for r in results:
            if r.status_code == 503:
                assert_error(r, 503)
        assert srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200

        # The engine dies: /health says so, requests fail fast with 503, the frontend stays up.
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while srv.http.get("/health").status_code != 503:
            assert time.monotonic() < deadline, "health still 200 after the engine died"
            time.sleep(0.1)
        assert_error(srv.http.get("/health"), 503)
        assert_error(srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
        assert srv.stop() == 0, srv.log()
        assert wait_gone(pids) == []
    finally:
        if srv.proc.poll() is None:
            srv.kill()
