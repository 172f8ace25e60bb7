"""Faults a held-out campaign found (issue 21), each checked on a real `tandem serve` with a tiny model:
a replica killed under load with --dp 2, SIGTERM at several points of start-up, and a long echo + logprobs
request's memory. Every wait is bounded; nothing here asserts a speed.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.server_utils import ServerProcess, children, free_port, process_tree, wait_gone
from tests.helpers.server_utils import runtime_dirs
from tests.helpers.tiny_models import make_tiny_model

CMPL = "/v1/completions"


# ---- a replica dies under load ------------------------------------------------------------------------------
async def _client(url: str, i: int, rng: random.Random, out: list[dict]) -> None:
    """One client: a streaming or plain request, some of which disconnect early; records what it saw."""
    stream, leave = rng.random() < 0.5, rng.random() < 0.15
    body = {"prompt": f"client {i}: once upon a time", "max_tokens": rng.randint(60, 300), "temperature": 0,
            "ignore_eos": True, "stream": stream}
    rec: dict = {"i": i, "stream": stream, "left": leave}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as h:
            if not stream:
                r = await h.post(CMPL, json=body)
                rec.update(status=r.status_code, type=r.headers.get("content-type", ""), text=r.text,
                           retry=r.headers.get("retry-after"))
            else:
                async with h.stream("POST", CMPL, json=body) as r:
                    rec.update(status=r.status_code, type=r.headers.get("content-type", ""),
                               retry=r.headers.get("retry-after"))
                    lines = []
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if leave and len(lines) > 6:
                            break                       # a client that goes away mid-stream
                    rec["lines"] = lines
                    if r.status_code != 200:
                        rec["text"] = "\n".join(lines)
    except httpx.HTTPError as e:                        # a reset, a truncated body, a refused connection
        rec["transport_error"] = f"{type(e).__name__}: {e}"
    out.append(rec)


def _outcome(rec: dict) -> str:
    """"finished", "left", "503" or "error event"; AssertionError for anything else: a reset, a truncated body,
    a plain-text error, a stream without [DONE]. A cut request must get an OpenAI-shaped 503 (Retry-After 1)
    or an SSE error event followed by [DONE]."""
    assert "transport_error" not in rec, rec
    if rec["status"] != 200:
        try:
            err = json.loads(rec["text"])["error"]
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"{rec['status']} whose body is not OpenAI's error JSON: {rec['text'][:200]!r}")
        assert rec["status"] == 503 and set(err) == {"message", "type", "param", "code"}, rec
        assert err["code"] == "503", rec       # as its stream event says: a refusal and an engine failure alike
        assert rec["retry"] == "1", rec
        return "503"
    if not rec["stream"]:
        assert json.loads(rec["text"])["choices"][0]["finish_reason"] == "length", rec["text"][-300:]
        return "finished"
    if rec["left"]:
        return "left"
    data = [line[6:] for line in rec["lines"] if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-2:]
    last = json.loads(data[-2])
    if "error" in last:
        assert last["error"]["type"] == "service_unavailable" and last["error"]["code"] == "503", last
        return "error event"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "finished"


async def _load(url: str, n: int, kill) -> list[dict]:
    rng, out = random.Random(7), []
    tasks = [asyncio.create_task(_client(url, i, rng, out)) for i in range(n)]
    await asyncio.to_thread(kill)
    await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return out


@pytest.mark.parametrize("grace,sigterm", [("30", False), ("0.2", False), ("30", True)],
                         ids=["grace-30", "grace-0.2", "sigterm-during-drain"])
def test_a_replica_killed_under_load_loses_nothing_on_the_other(tiny_llama, tmp_path, grace, sigterm):
    """--dp 2, 32 clients (half streaming, some leaving early), then SIGKILL of one replica's engine. Every
    client gets a finished answer or an OpenAI-shaped 503 / SSE error event + [DONE], never a plain-text
    body, a reset or a truncated stream; with the default grace the other replica's requests finish; new
    requests during the drain get 503 + Retry-After; the server exits 1 and leaves nothing behind, also when
    a SIGTERM comes in the middle of that teardown."""
    srv = ServerProcess(["--model", tiny_llama, "--kv-cache-tokens", "8192", "--dp", "2",
                         "--engine-failure-grace", grace], str(tmp_path / "server.log"))
    pids = process_tree(srv.proc.pid)
    during: list[httpx.Response] = []

    def kill() -> None:
        _wait_both_busy(srv)
        os.kill(min(children(srv.proc.pid)), signal.SIGKILL)
        time.sleep(0.5)
        try:                                            # a request sent during the drain
            during.append(httpx.post(srv.url + CMPL, json={"prompt": "late", "max_tokens": 2}, timeout=30,
                                     trust_env=False))
        except httpx.HTTPError:
            pass                                        # the grace was over and the server gone: fine
        if sigterm:
            srv.proc.send_signal(signal.SIGTERM)        # during the drain: ends it early, same rules
    try:
        outcomes = [_outcome(r) for r in asyncio.run(_load(srv.url, 32, kill))]
        assert outcomes.count("503") + outcomes.count("error event") >= 1, outcomes     # the dead replica's
        if grace == "30" and not sigterm:
            assert outcomes.count("finished") >= 8, outcomes                           # the live replica's
            assert during and during[0].status_code == 503 and during[0].headers["retry-after"] == "1"
            assert "replica" in during[0].json()["error"]["message"]
        assert srv.wait_exit(60) == 1, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.kill()
    assert wait_gone(pids) == []
    assert runtime_dirs(*pids) == []
    assert "Traceback" not in srv.log() and "Cancel" not in srv.log(), srv.log()


def _wait_both_busy(srv: ServerProcess, timeout: float = 120.0) -> None:
    """Until each replica runs at least two requests (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        running = {k: v for k, v in srv.metrics().items()
                   if k.startswith("tandem:num_requests_running{") and 'replica=""' not in k and "replica=" in k}
        if len(running) == 2 and all(v >= 2 for v in running.values()):
            return
        assert time.monotonic() < deadline, running
        time.sleep(0.05)


# ---- SIGTERM during start-up --------------------------------------------------------------------------------
def _started(pid: int, stage: str) -> bool:
    """stage "engine": the engine process exists, its device process not yet; "device": the device process
    exists (the model is loading); "serving": /health answered."""
    kids = children(pid)
    if stage == "engine":
        return len(kids) == 1 and not children(kids[0])
    return len(kids) == 1 and len(children(kids[0])) == 1


@pytest.mark.parametrize("stage", ["engine", "device"])
def test_sigterm_during_start_up_exits_0_and_leaves_nothing(tiny_llama, tmp_path, stage):
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", tiny_llama, "--port",
                             str(free_port()), "--kv-cache-tokens", "2048", "--device-threads", "1",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not _started(proc.pid, stage):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            seen.update(process_tree(proc.pid))
            time.sleep(0.005)
        seen.update(process_tree(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert wait_gone(sorted(seen)) == []
    assert runtime_dirs(*seen) == []


# ---- prompt logprobs in bounded memory ----------------------------------------------------------------------
def _status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def test_long_echo_with_logprobs_keeps_device_memory_bounded(tmp_path_factory):
    """An 8,000-token prompt with echo and logprobs=20 over a 49,152-token vocabulary. Alone (prefill chunks of
    2,048 tokens), the device process's peak RSS rises by far less than one chunk's [2048, vocab] fp32 logits
    (400 MB; before the fix it rose by ~720 MB) and its RSS returns near where it was. Beside a stream (which
    makes the chunks small), that stream keeps producing tokens meanwhile."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny8k"), max_position_embeddings=8192)
    srv = ServerProcess(["--model", model, "--device-threads", "1", "--kv-cache-tokens", "20000"],
                        str(tmp_path_factory.mktemp("log") / "server.log"))
    try:
        (engine,) = children(srv.proc.pid)
        (device,) = children(engine)
        body = {"prompt": [28] * 8000, "max_tokens": 1}
        echo = {**body, "echo": True, "logprobs": 20}
        assert srv.http.post(CMPL, json=body, timeout=300).status_code == 200     # same shapes, no logprobs
        rss0, peak0 = _status_mb(device, "VmRSS"), _status_mb(device, "VmHWM")
        r = srv.http.post(CMPL, json=echo, timeout=300)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == 8001 and lp["token_logprobs"][0] is None
        assert all(len(top) == 20 for top in lp["top_logprobs"][1:8000])
        assert _status_mb(device, "VmHWM") - peak0 < 250, (peak0, _status_mb(device, "VmHWM"))
        assert _status_mb(device, "VmRSS") - rss0 < 150, (rss0, _status_mb(device, "VmRSS"))

        got: list[float] = []
        stop = threading.Event()

        def stream() -> None:
            with httpx.Client(base_url=srv.url, timeout=300, trust_env=False) as h:
                with h.stream("POST", CMPL, json={"prompt": "once", "max_tokens": 4000, "ignore_eos": True,
                                                  "stream": True}) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            got.append(time.monotonic())
                        if stop.is_set():
                            return
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while len(got) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        assert srv.http.post(CMPL, json=echo, timeout=300).status_code == 200
        end = time.monotonic()
        stop.set()
        t.join(60)
        assert sum(start <= x <= end for x in got) >= 2                # the other stream went on meanwhile
    finally:
        assert srv.stop() == 0, srv.log()


# ---- a child whose parent died before it armed PR_SET_PDEATHSIG --------------------------------------------
def test_a_child_orphaned_before_it_armed_the_death_signal_exits():
    # Was: an engine process whose frontend died while the engine imported torch lived on (PPID 1), holding
    # its shared memory: PR_SET_PDEATHSIG only covers deaths after it is set.
    from tandem.lifeline import PARENT_ENV, child_env
    code = "from tandem.lifeline import die_with_parent; die_with_parent(); print('alive')"
    ok = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "alive", ok
    orphan = subprocess.run([sys.executable, "-c", code], env={**os.environ, PARENT_ENV: str(os.getpid() + 1)},
                            capture_output=True, text=True, timeout=60)       # "spawned by" another process
    assert orphan.returncode == 1 and orphan.stdout == "", orphan
