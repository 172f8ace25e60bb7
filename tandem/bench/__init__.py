"""`tandem bench`: offline throughput, an OpenAI-API serving client, peers in one run, and a roofline.

Shared here: the machine description every JSON result carries, and percentile helpers.
"""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int | None = None) -> dict[str, Any]:
    import torch
    info = {"nproc": os.cpu_count(), "cpu_model": cpu_model(), "torch": torch.__version__,
            "threads": threads, "python": platform.python_version()}
    caps = isa_caps()
    return {**info, "isa_caps": caps} if caps else info


def isa_caps() -> dict[str, str]:
    """The ISA caps set for this run (TANDEM_ISA=avx2 and oneDNN's / MKL's / ATen's own, as an AVX2 machine
    emulated on an AVX-512 one; a vLLM peer then runs its AVX2 kernel build, vllm_peer.VllmServer.env): part of
    what was measured, so a capped run's results say so."""
    return {k: os.environ[k] for k in ("TANDEM_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                       "ATEN_CPU_CAPABILITY") if os.environ.get(k)}


def engine_threads(config) -> int:
    """The torch threads tandem's device runs with under `config` (the peers get the same count)."""
    from ..device.ranks import default_device_threads
    return config.device_threads or default_device_threads()


def write_json(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


def write_json_md(path: str, result: dict, md: str) -> None:
    """A benchmark's JSON at `path` and its rendered table beside it (.md), printed too."""
    write_json(path, result)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(md)
    print(md)


def interleaved_best(fns: list, reps: int) -> list[float]:
    """Best wall seconds of each of `fns` over `reps` rounds that run them one after another (after one warm-up
    call each): a drifting machine slows every candidate of a round alike, so their ratios hold."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def line(label: str, value: Any, fmt: str = "") -> None:
    """One row of the result blocks: the label padded to 40 columns, as vllm and sglang print them."""
    print("{:<40} {:<10{}}".format(label, value, fmt))


def rule(title: str = "", fill: str = "=") -> None:
    print("{s:{c}^{n}}".format(s=f" {title} " if title and fill == "=" else title, n=50, c=fill))
