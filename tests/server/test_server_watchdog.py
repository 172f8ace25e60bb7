"""--watchdog-timeout on a real `tandem serve`: the device process hangs mid-step (SIGSTOP while two requests,
one streamed, are running), the engine stays silent, and after the watchdog's span every client is answered
(503 + Retry-After, or an error event then [DONE]), the engine is killed and the server exits 1 leaving
nothing behind. Every wait is bounded; nothing here asserts a speed beyond those bounds."""
from __future__ import annotations

import os
import signal
import threading

import httpx

from tests.helpers.server_utils import (ServerProcess, assert_error, children, process_tree, runtime_dirs,
                                        sse_events, wait_gone)
from tests.helpers.tiny_models import make_tiny_model
from tests.server.test_server_deadlines import LONG, assert_error_event


def test_a_device_hung_mid_step_ends_the_server_with_every_client_answered(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama", max_position_embeddings=4096)
    srv = ServerProcess(["--model", model, "--kv-cache-tokens", "8192", "--device-threads", "1",
                         "--health-timeout", "1", "--watchdog-timeout", "3"], str(tmp_path / "server.log"))
    answers: dict[str, object] = {}
    first = threading.Event()

    def streamed() -> None:
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as h:
            with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
                answers["stream"] = (r.status_code, sse_events(lines))

    def plain() -> None:
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as h:
            answers["plain"] = h.post("/v1/completions", json=LONG)

    threads = [threading.Thread(target=f, daemon=True) for f in (streamed, plain)]
    try:
        for t in threads:
            t.start()
        assert first.wait(60), srv.log()
        srv.wait_metric("tandem:num_requests_running", lambda v: v == 2)
        pids = process_tree(srv.proc.pid)
        (engine,) = children(srv.proc.pid)
        (device,) = children(engine)
        os.kill(device, signal.SIGSTOP)             # mid-step: both requests are running
        assert srv.wait_exit(120) == 1, srv.log()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
    finally:
        if srv.proc.poll() is None:
            srv.kill()
    status, events = answers["stream"]
    assert status == 200
    assert "--watchdog-timeout" in assert_error_event(events, "503", "service_unavailable")["message"]
    resp = answers["plain"]
    assert "--watchdog-timeout" in assert_error(resp, 503)["message"] and resp.headers["retry-after"] == "1"
    assert wait_gone(pids) == []
    assert runtime_dirs(*pids) == []
    assert "Traceback" not in srv.log(), srv.log()
