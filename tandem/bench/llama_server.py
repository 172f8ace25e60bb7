"""llama.cpp's own `llama-server` (built by llamacpp_tools.build_tools) as a benchmark peer: continuous batching
over `slots` parallel slots, the way its users serve many clients on a CPU.

run(prompts, output_len) sends every prompt at once, each from its own client thread, to /completion as token ids
(greedy, EOS ignored, no prompt cache reuse) and returns the wall seconds until the last answer; every answer must
carry exactly output_len tokens, or the run fails (a peer that stops early would look fast).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .engines import Peer
from .http_peer import free_port, wait_healthy


class LlamaServerPeer(Peer):
    def __init__(self, bin_dir: str, model_path: str, threads: int, slots: int, slot_context: int,
                 log_path: str | None = None, start_timeout_s: float = 600.0) -> None:
        self.name, self.batch_size = f"llama-server ({slots} slots)", slots
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [os.path.join(bin_dir, "llama-server"), "-m", model_path, "-t", str(threads), "-tb", str(threads),
               "-np", str(slots), "-c", str(slots * slot_context), "--host", "127.0.0.1", "--port", str(self.port),
               "--no-webui"]
        self._log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        if not wait_healthy(self.proc, self.url, timeout_s, "llama-server", poll_s=0.5):
            self.close()
            raise TimeoutError(f"llama-server not ready after {timeout_s:.0f} s")

    def _complete(self, prompt: list[int], output_len: int) -> int:
        body = json.dumps({"prompt": prompt, "n_predict": output_len, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "stream": False}).encode()
        req = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        return int(out.get("tokens_predicted", 0))

    def run(self, prompts, output_len):
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            counts = list(pool.map(lambda p: self._complete(p, output_len), prompts))
        wall = time.perf_counter() - start
        if any(c != output_len for c in counts):
            raise RuntimeError(f"llama-server generated {counts} tokens, not {output_len} each")
        return wall

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
