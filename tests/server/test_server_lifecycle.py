"""Server life cycle on a tiny model: SIGTERM mid-request, a bounded waiting queue, an engine that dies, a
frontend killed with SIGKILL.

Each test starts its own `tandem serve` process and checks how it exits and that it leaves no process and
no shared-memory or socket folder behind.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers.server_utils import (LONG, ServerProcess, assert_error, process_tree, runtime_dirs, sse_events,
                                        wait_gone)



@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return tiny_llama


def start(model_dir, tmp_path, *extra) -> ServerProcess:
    return ServerProcess(["--model", model_dir, "--kv-cache-tokens", "8192", "--device-threads", "1", *extra],
                         str(tmp_path / "server.log"))


def test_sigterm_mid_request_exits_0_and_leaves_nothing(model_dir, tmp_path):
    srv = start(model_dir, tmp_path)
    pids = process_tree(srv.proc.pid)
    assert len(pids) == 3, pids               # frontend, engine process, CPU device process
    assert len(runtime_dirs(*pids)) == 2      # the frontend's IPC sockets, the engine's shared memory
    lines: list[str] = []
    plain: list[httpx.Response] = []
    first = threading.Event()

    def stream():
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
            with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    first.set()

    def non_stream():
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
            plain.append(h.post("/v1/completions", json=LONG))

    threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=non_stream, daemon=True)]
    for t in threads:
        t.start()
    assert first.wait(60), srv.log()
    srv.wait_metric("tandem:num_requests_running", lambda v: v == 2)
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "service_unavailable"     # ended by the shutdown, not by length
    assert_error(plain[0], 503)                                     # not a 200 with partial text
    assert plain[0].headers["retry-after"] == "1"
    assert wait_gone(pids) == []
    assert runtime_dirs(*pids) == []


def test_queue_bound_then_engine_death(model_dir, tmp_path):
    srv = start(model_dir, tmp_path, "--scheduler", "serial", "--max-running-requests", "1",
                "--max-waiting-requests", "1", "--no-exit-on-engine-failure")
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
                assert r.headers["retry-after"] == "1"
        assert srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200

        # The engine dies: /health says so, requests fail fast with 503, the frontend stays up (as asked).
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while srv.http.get("/health").status_code != 503:
            assert time.monotonic() < deadline, "health still 200 after the engine died"
            time.sleep(0.1)
        assert_error(srv.http.get("/health"), 503)
        assert_error(srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
        assert wait_gone(pids[1:]) == []
        assert runtime_dirs(*pids[1:]) == []  # the survivor removed the engine's shared memory
        assert srv.stop() == 0, srv.log()
        assert wait_gone(pids) == []
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def test_engine_death_fails_requests_then_exits_nonzero(model_dir, tmp_path):
    srv = start(model_dir, tmp_path)
    try:
        pids = process_tree(srv.proc.pid)
        out: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: out.append(
            httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60, trust_env=False)), daemon=True)
        waiting.start()
        srv.wait_metric("tandem:num_requests_running", lambda v: v == 1)
        os.kill(srv.engine_pid(), signal.SIGKILL)
        waiting.join(60)
        assert_error(out[0], 503)             # the in-flight request is failed first
        assert srv.wait_exit() == 1, srv.log()  # then the server exits, so that a supervisor restarts it
        assert wait_gone(pids) == []
        assert runtime_dirs(*pids) == []
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def test_sigkill_of_the_frontend_is_swept_at_the_next_start(model_dir, tmp_path):
    srv = start(model_dir, tmp_path)
    pids = process_tree(srv.proc.pid)
    srv.kill()                                # SIGKILL to all three: nobody survives to clean up
    assert wait_gone(pids) == []
    left = runtime_dirs(*pids)
    assert len(left) == 2
    (tmp_path / "again").mkdir()
    again = start(model_dir, tmp_path / "again")
    try:
        assert [d for d in left if os.path.exists(d)] == []
    finally:
        assert again.stop() == 0
