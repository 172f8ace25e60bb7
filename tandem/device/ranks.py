"""How device ranks are sized and started: their threads, the spec they build from, their environment, the
device processes the scheduler launches into (alone, tp rank 0, or every pipeline stage: spawn_device) and
the process of a tp rank other than 0 (spawn_rank). Below both the engine (its ProcessExecutor,
process/executor.py, starts rank 0 and the other ranks of node 0) and the device processes
(parallel/tp_worker.py starts those of node R > 0), so the device layer never imports the engine.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass

from ..config import EngineConfig
from ..lifeline import child_env
from .runner_spec import RunnerSpec


@dataclass(frozen=True)
class DistInfo:
    """Where one rank sits in the group; plain data (it crosses process and machine boundaries)."""
    rank: int
    size: int
    local_rank: int           # index among this machine's ranks (its CUDA device)
    init_method: str          # file://... (one machine) or tcp://HOST:PORT (node 0's rendezvous)
    threads: int              # torch threads of this rank
    loopback: bool            # every rank on this machine: gloo talks over "lo"
    comm: str = "auto"        # "auto": shared memory for the forward's collectives when all ranks share a host
    nnodes: int = 1           # machines the group spans, size / nnodes ranks on each (rank // that: its node)


SMALL_MODEL_PARAMS = 20_000_000


def num_params(c) -> int:
    """Weights of a decoder with this config (embeddings counted once when tied; every expert and router)."""
    h = c.hidden_size
    attn = h * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * h
    mlp = sum(c.num_experts * (3 * h * c.moe_intermediate_size + h) if c.is_moe(i) else 3 * h * c.intermediate_size
              for i in range(c.num_layers))
    embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * attn + mlp + embed


def default_device_threads(params: int | None = None) -> int:
    """Torch threads of the CPU device process.

    Measured on 2 cores (benchmarks/overlap.py, docs/design.md): SmolLM2-135M decodes 1.8x faster with both cores in
    the forward (the scheduler needs ~1 ms per ~190 ms step), while a small model whose host work is about
    half its forward runs as fast with one core left to the scheduler, and overlaps fully (1.4 % device idle
    against 29 % with two threads). So: every core for models above SMALL_MODEL_PARAMS, one core less below.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if params is not None and params < SMALL_MODEL_PARAMS and cores > 1:
        return cores - 1
    return max(1, cores)


def rank_threads(config: EngineConfig, model_config) -> int:
    """Torch threads of each device rank: device_threads, or this node's default split over its tp ranks
    (or its pipeline stages)."""
    if config.device_threads:
        return config.device_threads
    ranks = config.tp_size * config.pp_size // config.nnodes
    return max(1, default_device_threads(num_params(model_config)) // ranks)


def init_group(info: DistInfo, device, timeout_s: float) -> str:
    """Join this rank's torch.distributed group (tp or pp): NCCL on CUDA, gloo on CPU (over "lo" when every rank
    is on this machine), timeout_s for the rendezvous and every single operation. Returns the backend."""
    import datetime

    import torch.distributed as dist
    if info.loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=info.init_method, rank=info.rank, world_size=info.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def runner_spec(config: EngineConfig, source) -> RunnerSpec:
    """What every rank builds itself from (the engine's options that reach the device side)."""
    return RunnerSpec(
        source=source, device=config.resolved_device(), dtype=config.resolved_dtype(),
        max_running=config.max_running_requests, spare_rows=config.spare_rows(), max_model_len=config.max_model_len,
        kv_cache_tokens=config.kv_cache_tokens, kv_memory_fraction=config.kv_memory_fraction,
        kv_cache_dtype=config.kv_cache_dtype, shared_prefix_attention=config.shared_prefix_attention,
        poison_future_map=config.poison_future_map, kernels=config.kernels, kernels_act=config.kernels_act,
        prefill_act=config.prefill_act, prefill_attention=config.prefill_attention,
        batch_invariant=config.batch_invariant,
        decode_attention=config.decode_attention,
        tp_size=config.tp_size, tp_comm=config.tp_comm, tp_reduce_chunks=config.tp_reduce_chunks, pp_size=config.pp_size,
        pp_layer_partition=config.pp_layer_partition,
        max_draft_rows=config.speculative_config.extra_rows if config.speculative_config is not None else 0,
        state_checkpoints=config.checkpoints() if source.config.linear_layers else 0)


# How long an idle OpenMP worker of a device process spins before it sleeps (libgomp's GOMP_SPINCOUNT; its default
# is 300,000). The device's threads take every core the scheduler shares: while the device's main thread runs Python
# between two parallel regions, or waits for the next launch, a spinning worker holds a core that the scheduler's
# "process results" of the step before needs. Measured (AMD EPYC, 2 vCPUs, 2 device threads, each pair run back to
# back): SmolLM2 overlap TPOT 4.58-5.13 -> 3.91-4.57 ms (3,000 and 30,000 between; 0 sleeps on every region: 7.4-7.8
# ms), the 6-layer Qwen3-30B-A3B-shaped file 8.9-9.4 -> 8.5-8.9 ms in six pairs, `tandem bench offline` 64 x 32 ->
# 128 11.35 / 11.95 -> 12.20 / 12.52 req/s; serial TPOT, a 2,000-token prefill (1.0-1.1 s) and the 1.5B-shaped dense
# file (25.9-26.7 ms) unchanged within their noise.
DEVICE_SPINCOUNT = "10000"


def device_env(threads: int) -> dict[str, str]:
    """The environment of a device process (or tp rank): its thread count, its OpenMP workers' spin before they
    sleep (DEVICE_SPINCOUNT), and torch's CPU allocator giving allocations of 2 MB and more transparent huge
    pages (THP_MEM_ALLOC_ENABLE); the user's own GOMP_SPINCOUNT and THP_MEM_ALLOC_ENABLE win.
    Huge pages, measured on the default model, 2 threads: TPOT -4 % at 128 tokens of context and -6 % at 2,000
    (the decode attention touches a new 4 KB page for every key's K and V; the weights are read every step)."""
    return child_env({"THP_MEM_ALLOC_ENABLE": "1", "GOMP_SPINCOUNT": DEVICE_SPINCOUNT, **os.environ,
                      "OMP_NUM_THREADS": str(threads)})


def rank_infos(size: int, nnodes: int, node_rank: int, threads: int, init_method: str,
               comm: str = "auto") -> list[DistInfo]:
    """The DistInfo of each rank of a group of `size` (tp ranks or pipeline stages) on this node (ranks
    node_rank * per_node ... ; rank 0 on node 0)."""
    per_node = size // nnodes
    loopback = nnodes == 1 or init_method.startswith(("tcp://127.", "tcp://localhost:"))
    return [DistInfo(node_rank * per_node + i, size, i, init_method, threads, loopback, comm, nnodes)
            for i in range(per_node)]


def spawn_device(sock: str, shm_path: str, threads: int, authkey: bytes) -> subprocess.Popen:
    """`python -m tandem.device.process.main`: a device process the scheduler launches into (alone, tp rank 0,
    or a pipeline stage), which connects back to the executor's socket with `authkey` (given on its stdin)."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem.device.process.main", sock, shm_path, str(threads)],
                            env=device_env(threads), stdin=subprocess.PIPE, close_fds=True)
    proc.stdin.write(authkey)
    proc.stdin.close()
    return proc


def spawn_rank(spec: RunnerSpec, info: DistInfo, module: str = "tandem.device.parallel.tp_worker") -> subprocess.Popen:
    """`python -m tandem.device.parallel.tp_worker` (a tp rank other than 0) or `tandem.device.parallel.pp_stage`
    (a pipeline stage on a node R > 0) with (spec, info) pickled on its stdin."""
    env = device_env(info.threads)
    proc = subprocess.Popen([sys.executable, "-m", module], env=env, stdin=subprocess.PIPE, close_fds=True)
    proc.stdin.write(pickle.dumps((spec, info)))
    proc.stdin.close()
    return proc


def rank_device(device: str, info: DistInfo):
    """The torch device of a rank: its local CUDA device, or the CPU."""
    import torch
    return torch.device("cuda", info.local_rank) if device.startswith("cuda") else torch.device(device)
