"""A server that tells the truth when it cannot serve in time, on a real `tandem serve` with a tiny model:
--max-queue-time (a request that waited too long for admission: 503 + Retry-After, or an error event and
[DONE] in a stream), a request's own `timeout` (408 `timeout`, or the error event), and the liveness of an idle
device (SIGSTOP of the device process with no request in flight: /health 503 and new requests 503 at once;
SIGCONT: healthy again). Every wait is bounded; nothing here asserts a speed beyond those bounds.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers.server_utils import ServerProcess, assert_error, children, sse_events
from tests.helpers.tiny_models import make_tiny_model

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HEALTH_TIMEOUT_S = 2.0
MAX_QUEUE_TIME_S = 1.0
# Thousands of tokens: runs for seconds at the least, much longer than MAX_QUEUE_TIME_S and the timeouts here.
LONG = {"prompt": "Once upon a time", "max_tokens": 3500, "temperature": 0, "ignore_eos": True}
SHORT = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=4096)
    srv = ServerProcess(["--model", model, "--kv-cache-tokens", "8192", "--device-threads", "1",
                         "--max-running-requests", "1", "--max-queue-time", str(MAX_QUEUE_TIME_S),
                         "--health-timeout", str(HEALTH_TIMEOUT_S)],
                        str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    assert "Traceback" not in srv.log(), srv.log()
    assert srv.stop() == 0, srv.log()


def wait_idle(srv: ServerProcess) -> None:
    srv.wait_metric("tandem:num_requests_running", lambda v: v == 0)
    srv.wait_metric("tandem:num_requests_waiting", lambda v: v == 0)


class Occupant:
    """A long streamed request holding the only running row until stop()."""

    def __init__(self, srv: ServerProcess) -> None:
        self.first, self.leave, self.lines = threading.Event(), threading.Event(), []
        self.thread = threading.Thread(target=self._run, args=(srv.url,), daemon=True)
        self.thread.start()
        assert self.first.wait(60), srv.log()

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as h:
            with h.stream("POST", CMPL, json={**LONG, "stream": True}) as resp:
                for line in resp.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: ") and '"text"' in line:
                        self.first.set()
                    if self.leave.is_set():
                        return              # the client goes away: the engine aborts it

    def stop(self) -> None:
        self.leave.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def stream_events(srv: ServerProcess, path: str, body: dict) -> tuple[int, list]:
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
        with h.stream("POST", path, json={**body, "stream": True}) as resp:
            return resp.status_code, sse_events(resp.iter_lines())


def assert_error_event(events: list, code: str, type_: str) -> dict:
    """The stream ends with an error event in OpenAI's shape, then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    err = events[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code and err["type"] == type_, err
    return err


def test_max_queue_time_answers_503_and_ends_a_stream_with_an_error_event(server):
    wait_idle(server)
    occupant = Occupant(server)            # holds the single running row (--max-running-requests 1)
    try:
        got: dict = {}

        def plain():
            got["plain"] = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 3}, timeout=60, trust_env=False)

        def streamed():
            got["stream"] = stream_events(server, CMPL, SHORT)

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        err = assert_error(got["plain"], 503)
        assert err["type"] == "service_unavailable" and "in the queue" in err["message"], err
        assert f"max_queue_time {MAX_QUEUE_TIME_S:g} s" in err["message"], err
        assert got["plain"].headers["retry-after"] == "1"
        status, events = got["stream"]
        assert status == 200                # the stream was open: its end says why
        assert "in the queue" in assert_error_event(events, "503", "service_unavailable")["message"]
        assert occupant.thread.is_alive()   # the occupant still holds the row: they could only wait
    finally:
        occupant.stop()
    wait_idle(server)
    assert server.http.post(CMPL, json=SHORT).status_code == 200           # an idle engine admits at once


def test_request_timeout_ends_a_running_request(server):
    wait_idle(server)
    r = server.http.post(CMPL, json={**LONG, "timeout": 0.5})
    err = assert_error(r, 408, None)
    assert err["type"] == "timeout" and err["code"] == "408" and "timeout of 0.5 s" in err["message"], err
    assert "retry-after" not in r.headers
    status, events = stream_events(server, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3500, "ignore_eos": True, "timeout": 0.5})
    assert status == 200
    assert "timeout of 0.5 s" in assert_error_event(events, "408", "timeout")["message"]
    wait_idle(server)                       # its row and KV were freed: the next request runs
    assert server.http.post(CMPL, json={**SHORT, "timeout": 60}).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("value", [0, -1, "5", True, [1]])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_bad_timeout_is_a_400_naming_it(server, path, value):
    body = {"prompt": "hi"} if path == CMPL else {"messages": [{"role": "user", "content": "hi"}]}
    err = assert_error(server.http.post(path, json={**body, "max_tokens": 2, "timeout": value}), 400, "timeout")
    assert "timeout" in err["message"]


def test_stopped_idle_device_turns_health_503_then_recovers(server):
    # Was: with nothing in flight, a stopped device process left /health 200 for 21 s and more, and a new
    # request hung: nothing asked the device anything. Now the idle engine probes it.
    wait_idle(server)
    assert server.http.get("/health").status_code == 200
    (engine,) = children(server.proc.pid)
    (device,) = children(engine)
    os.kill(device, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        while server.http.get("/health").status_code != 503:
            # A generous bound: before the probe this stayed 200 for as long as the device was stopped.
            assert time.monotonic() - stopped < HEALTH_TIMEOUT_S + 8, "health still 200 with the device stopped"
            time.sleep(0.1)
        err = assert_error(server.http.get("/health"), 503)
        assert "no progress" in err["message"] and err["code"] == "503", err
        late = server.http.post(CMPL, json=SHORT, timeout=10)          # at once, not a hang
        assert_error(late, 503)
        assert late.headers["retry-after"] == "1"
    finally:
        os.kill(device, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while server.http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "health still 503 after SIGCONT"
        time.sleep(0.1)
    r = server.http.post(CMPL, json=SHORT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
