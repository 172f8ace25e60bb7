"""Cold and warm load of a GGUF: seconds to LLM(...) ready, the cache folder's size, the device process's RSS.

    python benchmarks/loading.py [--model M.gguf] [--kernels native|torch] [--write-q4km OUT.gguf]

Cold: an empty TANDEM_CACHE_DIR (a fresh temporary folder); warm: the same folder again. Each load runs in a
fresh interpreter, so imports are counted as a user sees them. --write-q4km writes a Q4_K_M-style file at the
default model's shape (Q5_0 where K = 576 is no multiple of 256, Q4_K ffn_down) from its weights, and exits.
Results: benchmarks/results/loading.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
from tandem import LLM
llm = LLM(sys.argv[1], kernels=sys.argv[2], kv_cache_tokens=4096)
ready = time.perf_counter() - t0
runner = llm.engine.executor
pid = runner.proc.pid if hasattr(runner, "proc") else os.getpid()
rss = {}
with open(f"/proc/{pid}/status") as f:
    for line in f:
        if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
            k, v = line.split(":")
            rss[k] = int(v.split()[0]) // 1024
llm.shutdown()
print(json.dumps({"ready_s": round(ready, 2), "device_rss_mib": rss}))
"""


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(d) for n in fs
               if not os.path.islink(os.path.join(r, n)))


def load_once(model: str, kernels: str, cache: str) -> dict:
    env = dict(os.environ, TANDEM_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", _CHILD, model, kernels], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["cache_mib"] = round(dir_bytes(cache) / 2**20, 2)
    return r


def write_q4km(out: str) -> None:
    """The default model's weights (dequantized) written as write_tiny_gguf's Q4_K_M mix, with its tokenizer."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from safetensors.torch import save_file
    from tests.helpers.tiny_models import write_tiny_gguf

    from tandem.bench.vllm_peer import hf_config_dict
    from tandem.model.loader import load_weights, resolve_model
    src = resolve_model(None)
    with tempfile.TemporaryDirectory() as d:
        sd = load_weights(src)
        save_file(sd, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf_config_dict(src.config), f)
        write_tiny_gguf(out, d, quant="Q4_K_M")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--kernels", default="native")
    ap.add_argument("--write-q4km", default=None, metavar="OUT")
    a = ap.parse_args()
    if a.write_q4km:
        write_q4km(a.write_q4km)
        return
    from tandem.model.loader import default_model_path
    model = a.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="tandem-load-") as cache:
        cold = load_once(model, a.kernels, cache)
        warm = load_once(model, a.kernels, cache)
    print(json.dumps({"model": os.path.basename(model), "file_mib": round(os.path.getsize(model) / 2**20, 1),
                      "kernels": a.kernels, "cold": cold, "warm": warm}))


if __name__ == "__main__":
    main()
