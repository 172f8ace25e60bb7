"""Tensor parallelism (issue 13): TP 2 / TP 3 give TP 1's greedy tokens (a divergence only at a near-tie of
TP 1's logits: the all-reduce sums in another order), on one machine and on two "nodes" on 127.0.0.1; shapes
that do not split are refused; a rank that dies fails requests (503) instead of hanging; SIGTERM leaves no
process or shared-memory folder behind. The forward's collectives run over shared memory (picked on one host)
and over gloo (tp_comm="gloo"): the same tokens."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.helpers.engine_checks import assert_no_leaks, run_with
from tests.helpers.server_utils import (ServerProcess, assert_rank_death_is_503, free_port, process_tree, runtime_dirs,
                                        wait_gone)
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.model.shard import TPLayout
from tests.model.test_parity import prompts_for

NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(kv_cache_tokens=4096, max_running_requests=16, device_threads=1, poison_future_map=True)


def reference(path: str, prompts) -> list:
    """TP 1's greedy outputs, with each token's top-2 logprobs (the near-tie check)."""
    llm = LLM(path, **ENGINE)
    try:
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
    finally:
        llm.shutdown()


def assert_same(outs, refs) -> None:
    """Equal token for token; a divergence is accepted only where TP 1's top-2 logprobs nearly tie."""
    for o, r in zip(outs, refs, strict=True):
        for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)):
            if a != b:
                top = r.logprobs[i][1]                  # [[id, logprob], ...] best first
                margin = top[0][1] - top[1][1]
                assert margin < NEAR_TIE and a == top[1][0], f"diverged at {i}: {a} vs {b}, margin {margin:.3g}"
                break
        assert len(o.token_ids) == len(r.token_ids)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("tp_comm", ["auto", "gloo"])
def test_tp2_equals_tp1_both_loops(arch, tp_comm, request):
    """Both transports of the forward's collectives: shared memory (picked on one host) and gloo. Three
    450-token prompts make a prefill step longer than the step broadcast's inline words (step_wire.INLINE)."""
    path = request.getfixturevalue(arch)
    prompts = prompts_for(49152, n=6) + [[3 + (7 * i + j) % 40000 for j in range(450)] for i in range(3)]
    refs = reference(path, prompts)
    llm = LLM(path, tp_size=2, tp_comm=tp_comm, **ENGINE)
    try:
        assert llm.engine.executor.tp_transport == {"auto": "shm", "gloo": "gloo"}[tp_comm]
        for loop in ("serial", "overlap"):
            assert_same(run_with(llm, loop, prompts, GREEDY), refs)
        comm = [d.comm for d in llm.engine.recorder.devices]
        assert min(comm) > 0                            # every step's collectives are timed for the trace
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp_comm", ["auto", "gloo"])
def test_tp3_on_smollm2_equals_tp1(tp_comm, smollm):
    prompt = [smollm.tokenizer.encode("The capital of France is")]
    refs = run_with(smollm, "overlap", prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=2))
    llm = LLM(tp_size=3, device_threads=1, poison_future_map=True, kernels_act="fp32",   # the fixture's mode
              tp_comm=tp_comm)
    try:
        assert llm.engine.executor.tp_transport == {"auto": "shm", "gloo": "gloo"}[tp_comm]
        for loop in ("serial", "overlap"):
            assert_same(run_with(llm, loop, prompt, SamplingParams(temperature=0, max_tokens=5)), refs)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch, source", [("qwen3", "hf"), ("gemma3", "hf"), ("gemma3", "gguf"), ("qwen3_moe", "hf"),
                                          ("mixtral", "gguf")])
def test_tp2_equals_tp1_new_architectures(arch, source, tmp_path_factory):
    """Qwen3 (q/k norms) and Gemma 3 (one KV head of 256: tp 2 replicates it, each rank keeping the head its
    2 query heads read; an 8-key sliding window, sandwich norms, tied embeddings scaled by sqrt(hidden)),
    from safetensors and from the GGUF test_architectures writes: tp 2 gives tp 1's greedy tokens through
    both loops, on prompts longer than the window. Qwen3-MoE and Mixtral: whole experts a rank (4 of 8 each, a
    rank adding the chosen experts it holds; test_moe checks the one-op decode path of that), the router whole on
    each rank."""
    from tests.helpers.tiny_models import MOE_ARCHS, TINY_ARCHS, make_tiny_model, write_tiny_gguf
    root = tmp_path_factory.mktemp(f"tp-{arch}")
    path = make_tiny_model(root / "hf", arch, seed=(TINY_ARCHS + MOE_ARCHS).index(arch) + 20)
    if source == "gguf":
        path = write_tiny_gguf(root / f"{arch}.gguf", path)
    prompts = prompts_for(49152, n=4, seed=2) + [[3 + (11 * i + j) % 40000 for j in range(40)] for i in range(2)]
    refs = reference(path, prompts)
    llm = LLM(path, tp_size=2, **ENGINE)
    try:
        c = llm.engine.model_config
        layouts = [TPLayout.of(c, 2, r) for r in range(2)]
        assert [(lay.expert_start, lay.experts) for lay in layouts] == ([(0, 4), (4, 4)] if c.num_experts else
                                                                           [(0, 0), (0, 0)])
        assert [(lay.heads, lay.kv_heads, lay.kv_head_start) for lay in layouts] == (
            [(2, 1, 0), (2, 1, 0)] if arch == "gemma3" else [(2, 1, 0), (2, 1, 1)])
        with pytest.raises(ValueError, match=r"tp_size 3 does not fit .*4 attention heads .*fit it: 1, 2, 4\)"):
            TPLayout.of(c, 3, 0)
        for loop in ("serial", "overlap"):
            assert_same(run_with(llm, loop, prompts, GREEDY), refs)
    finally:
        llm.shutdown()


def test_shapes_and_options_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"tp_size 2 does not fit .*9 attention heads .*fit it: 1, 3\)"):
        LLM(tp_size=2)
    with pytest.raises(ValueError, match="split evenly over 2 nodes"):
        EngineConfig(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="needs dist_init_addr HOST:PORT"):
        EngineConfig(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="device_backend must be"):
        EngineConfig(tp_size=2, device_backend="inline")
    with pytest.raises(ValueError, match="runs only device ranks"):
        LLM(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


def test_two_nodes_on_localhost_equal_one(tiny_llama):
    """Node 1 is a separate `tandem serve --node-rank 1` launch that joins node 0's engine over TCP."""
    prompts = prompts_for(49152, n=4, seed=1)
    refs = reference(tiny_llama, prompts)
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", tiny_llama, "--tp", "2",
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--kv-cache-tokens",
                              "4096", "--max-running-requests", "16", "--device-threads", "1",
                              "--poison-future-map", "--log-level", "warning"])
    try:
        llm = LLM(tiny_llama, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **ENGINE)
        try:
            assert llm.engine.executor.tp_transport == "shm"     # two launches, one host: shared memory
            assert_same(llm.generate(prompts, GREEDY, use_tqdm=False), refs)
            assert_no_leaks(llm)
        finally:
            llm.shutdown()
        assert node1.wait(timeout=30) == 0              # rank 0's quit ends node 1 cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()




def tp_server(path: str, tmp_path) -> ServerProcess:
    return ServerProcess(["--model", path, "--tp", "2", "--kv-cache-tokens", "8192", "--device-threads", "1"],
                         str(tmp_path / "server.log"))


def test_tp_server_sigterm_leaves_nothing(tiny_llama, tmp_path):
    srv = tp_server(tiny_llama, tmp_path)
    pids = process_tree(srv.proc.pid)
    assert len(pids) == 4, pids                         # frontend, engine, tp rank 0 and tp rank 1
    assert len(runtime_dirs(*pids)) == 2
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert wait_gone(pids) == []
    assert runtime_dirs(*pids) == []


def test_tp_rank_death_is_503_not_a_hang(tiny_llama, tmp_path):
    assert_rank_death_is_503(tp_server(tiny_llama, tmp_path), b"tandem.device.parallel.tp_worker", ranks=1)


def test_gguf_blocks_shard_on_block_boundaries_and_dequantize_otherwise():
    """Row-parallel slices keep their GGUF blocks when K is cut on a 32-weight boundary (bit-exact), and
    fall back to fp32 (named in the log) when not."""
    import gguf
    import numpy as np
    import torch

    from tandem.kernels.quant import Q4_1, QuantWeight
    from tandem.model.shard import _rows, cols
    w = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    q = QuantWeight.from_gguf(torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)), Q4_1, 128)
    dense, cut = q.dequantize(), []
    kept = cols(q, 32, 96, cut, "o")
    assert isinstance(kept, QuantWeight) and cut == [] and torch.equal(kept.dequantize(), dense[:, 32:96])
    assert torch.equal(_rows(q, 2, 5).dequantize(), dense[2:5])
    assert torch.equal(_rows(q, 6, 8, pad_to=4).dequantize()[2:], torch.zeros(2, 128))    # vocab padding
    fallback = cols(q, 16, 48, cut, "o")
    assert not isinstance(fallback, QuantWeight) and cut == ["o"] and torch.equal(fallback, dense[:, 16:48])
