"""Helpers for the server tests: run `tandem serve` as a real process on a free 127.0.0.1 port.

Every wait is bounded (a hang fails the test instead of blocking the suite); no assertion depends on speed.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import threading

import httpx

from tandem import runtime_files

START_TIMEOUT_S = 180.0
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True}   # runs ~seconds
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (a snapshot: take it while the server runs)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    return tree


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = STOP_TIMEOUT_S) -> list[int]:
    """Wait until none of pids is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "warning", *args], stdout=self._log, stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env})
        self.http = httpx.Client(base_url=self.url, timeout=60.0, trust_env=False)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.http.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {START_TIMEOUT_S} s:\n{self.log()}")

    def openai_client(self, timeout: float = 120.0):
        """The official openai client on this server: loopback only (no proxy from the environment), no retries."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=timeout,
                             http_client=httpx.Client(trust_env=False))

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def engine_pid(self) -> int:
        kids = children(self.proc.pid)
        assert len(kids) == 1, f"expected one engine process, found {kids}"
        return kids[0]

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value, and bare `name` -> value of the first series with that name."""
        out: dict[str, float] = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
                out.setdefault(key.split("{", 1)[0], float(value))
        return out

    def wait_metric(self, name: str, pred, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics().get(name)
            if value is not None and pred(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} = {value} after {timeout} s")
            time.sleep(0.05)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """The exit code of a server that stops by itself (bounded wait)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server still running {timeout} s later:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the server; return its exit code (bounded wait)."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit {STOP_TIMEOUT_S} s after signal {sig}:\n{self.log()}")
        finally:
            self._log.close()

    def kill(self) -> None:
        for pid in reversed(process_tree(self.proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()


def sse_events(lines) -> list:
    """Parse SSE `data:` lines into JSON objects, with the string "[DONE]" for the end marker."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int, param: str | None = ...) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not ...:
        assert err["param"] == param, err
    return err


def runtime_dirs(*pids: int) -> list[str]:
    """The shared-memory and IPC folders these processes own (tandem/runtime_files.py)."""
    import tempfile
    return [os.path.join(base, n) for base in {runtime_files.shm_dir(), tempfile.gettempdir()}
            for n in os.listdir(base) for pid in pids if n.startswith((f"tandem-dev-{pid}-", f"tandem-ipc-{pid}-"))]


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def assert_rank_death_is_503(srv: "ServerProcess", module: bytes, ranks: int) -> None:
    """SIGKILL the first of the engine's `ranks` device processes running `module` while a LONG request runs:
    the request ends in a 503 (no hang), the server exits 1, and no process or runtime folder is left."""
    try:
        pids = process_tree(srv.proc.pid)
        victims = [p for p in children(srv.engine_pid()) if module in cmdline(p)]
        assert len(victims) == ranks, victims
        out: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: out.append(
            httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60, trust_env=False)), daemon=True)
        waiting.start()
        srv.wait_metric("tandem:num_requests_running", lambda v: v == 1)
        os.kill(victims[0], signal.SIGKILL)
        waiting.join(60)
        assert out, f"the request hung after a device process ({module.decode()}) died"
        assert_error(out[0], 503)
        assert srv.wait_exit() == 1, srv.log()
        assert wait_gone(pids) == []
        assert runtime_dirs(*pids) == []
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def offline_greedy_chat(messages: list[dict], max_tokens: int, kv_tokens: int) -> dict:
    """The default model's greedy answer to `messages`, offline: what a server test on that model compares with
    ({"chat": RequestOutput, "name": the served model name})."""
    from tandem import LLM, SamplingParams
    llm = LLM(None, kv_cache_tokens=kv_tokens)
    try:
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        return {"chat": out, "name": llm.engine.model_name}
    finally:
        llm.shutdown()


def default_model_server(tmp_path_factory, kv_tokens: int):
    """A module fixture's body: `tandem serve` on the default model, stopped (exit 0) at the end."""
    srv = ServerProcess(["--kv-cache-tokens", str(kv_tokens)], str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def assert_leaving_aborts(server: "ServerProcess", model: str, path: str, body: dict, line_prefix: str) -> None:
    """A streaming client that leaves after 3 lines starting with `line_prefix` aborts its request: the abort
    counter of `model` grows by one and nothing is left running."""
    key = f'tandem:request_success_total{{finished_reason="abort",model_name="{model}"}}'
    aborted = server.metrics().get(key, 0.0)
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as h:
        with h.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            got = 0
            for line in resp.iter_lines():
                got += line.startswith(line_prefix)
                if got == 3:
                    break                      # leave mid-stream: closing the connection aborts the request
    server.wait_metric(key, lambda v: v == aborted + 1)
    assert server.wait_metric("tandem:num_requests_running", lambda v: v == 0.0) == 0.0
