"""What the peers run as HTTP servers share (vLLM's OpenAI server, llama.cpp's llama-server): a free loopback
port, and the wait until the started process answers /health."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, name: str,
                 log_tail: Callable[[], str] = str, poll_s: float = 1.0) -> bool:
    """True once base_url/health answers 200; RuntimeError at once if the process exits; False at timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {log_tail()}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(poll_s)
    return False
