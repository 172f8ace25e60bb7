"""Pipeline parallelism (issue 20): PP 2 and PP 3 give PP 1's tokens bit for bit, greedy and seeded, under the
PP loop and the serial loop, on tiny Llama and Qwen2 (fp32 weights, and Q8_0 GGUF blocks in the default int8
activation mode) and on the real SmolLM2 (30 layers, 2 stages); retraction and aborts with micro-batches in
flight leave no leaked slot or row; what stages cannot serve is refused before anything starts; a killed
stage is an error, not a hang. The FutureMap is poisoned (-1) in these engines: a gather of an entry never
relayed to the first stage raises.

Why bit for bit: a stage boundary passes the hidden states and the native layers' residual as they are, and
with GGUF blocks in the int8 mode every row's arithmetic is per row (batch-invariant), so splitting the layers
over stages and the batch into micro-batches changes no bit of a row's logits: the Q8_0 model's tokens,
logprobs and prompt logprobs are equal. fp32 weights run the fp32 GEMM, whose sums depend on the batch's
row count; there the tokens are compared (equal on these prompts), not the logprobs.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.server_utils import (ServerProcess, assert_rank_death_is_503, free_port, process_tree, runtime_dirs,
                                        sse_events, wait_gone)
import tandem.scheduler.loops as loops
import tandem.scheduler.results as results
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.device.parallel.pp_split import even_sizes, ranges
from tests.scheduler.test_overlap import run_script

ENGINE = dict(kv_cache_tokens=4096, max_running_requests=16, device_threads=1, poison_future_map=True)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)


def prompts(n: int = 7) -> list[list[int]]:
    """Prompts of different lengths (decode rows of different lengths share a micro-batch), one past a
    300-token prefill."""
    return [[3 + (7 * i + 5 * j) % 40000 for j in range(4 + 9 * i)] for i in range(n - 1)] + \
        [[5 + j % 3000 for j in range(300)]]


class Depths(list):
    """How many micro-batches were in flight each time the loop processed the oldest; `chunked`: how often
    one request's prefill chunks were in two of them (the chunked pipeline)."""
    chunked = 0


def watch_depth(llm, monkeypatch) -> Depths:
    """Record the depths, and check the PP loop's first invariant each time: a request rides in at most one
    in-flight micro-batch that samples for it (its other rows there are non-final prefill chunks)."""
    s, depths = llm.engine.scheduler, Depths()
    oldest = results.process_oldest

    def process_oldest(sched) -> None:
        if sched is s:
            depths.append(len(s.result_queue))
            sampling = [id(r) for b, _ in s.result_queue for r, kept in zip(b.reqs, b.samples) if kept]
            assert len(sampling) == len(set(sampling)), "a request sampled in two in-flight micro-batches"
            ids = [id(r) for b, _ in s.result_queue for r in set(b.reqs)]
            depths.chunked += len(ids) - len(set(ids))
        oldest(sched)
    monkeypatch.setattr(results, "process_oldest", process_oldest)     # process_pending's calls
    monkeypatch.setattr(loops, "process_oldest", process_oldest)       # the loops' calls
    return depths


def outputs(llm, loop: str, ps, params) -> list[list[int]]:
    llm.engine.config = llm.engine.config.replace(scheduler=loop)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """3-layer tiny models (PP 3 needs a layer a stage): fp32 Llama, fp32 Qwen2, and the Llama as Q8_0 GGUF
    blocks, which the default kernels_act="int8" runs through the int8 activation path."""
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    llama = make_tiny_model(tmp_path_factory.mktemp("pp-llama"), "llama", num_hidden_layers=3)
    qwen2 = make_tiny_model(tmp_path_factory.mktemp("pp-qwen2"), "qwen2", num_hidden_layers=3)
    q8 = write_tiny_gguf(tmp_path_factory.mktemp("pp-q8") / "tiny-q8_0.gguf", llama, quant="Q8_0")
    moe = make_tiny_model(tmp_path_factory.mktemp("pp-moe"), "qwen3_moe")      # expert, dense, expert layers
    moe_q8 = write_tiny_gguf(tmp_path_factory.mktemp("pp-moe-q8") / "tiny-moe-q8_0.gguf", moe, quant="Q8_0")
    return {"llama": llama, "qwen2": qwen2, "llama-q8_0": q8, "qwen3_moe-q8_0": moe_q8}


def test_a_stage_holds_only_its_layers(three_layers):
    """Built in this process with a stand-in for its PPGroup: each stage's weights, KV cache and the ends it
    owns (the embedding on the first stage, the final norm, LM head and sampler on the last)."""
    from types import SimpleNamespace

    import torch

    from tandem.device.model_runner import ModelRunner
    from tandem.device.ranks import runner_spec
    from tandem.model.loader import resolve_model
    config = EngineConfig(model=three_layers["llama"], kv_cache_tokens=64, max_running_requests=2, device="cpu")
    spec = runner_spec(config, resolve_model(config.model))
    for stage in (0, 1):
        pp = SimpleNamespace(first=stage == 0, last=stage == 1, layers=ranges(even_sizes(3, 2))[stage],
                             device=torch.device("cpu"), spans_nodes=False, min_int=lambda v: v)   # alone
        ex = ModelRunner(spec, pp=pp)
        assert len(ex.model.layers) == ex.kv_cache.num_layers == ex.kv_cache.data.shape[1] == 2 - stage
        assert (ex.model.embed is not None) == (stage == 0)      # untied embeddings: the head is its own
        assert (ex.model.lm_head is not None) == (ex.model.final_norm is not None) == ex.samples == (stage == 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-q8_0", "qwen3_moe-q8_0"])
def test_pp2_and_pp3_equal_pp1(arch, three_layers, monkeypatch):
    path, ps = three_layers[arch], prompts()
    ref = LLM(path, **ENGINE)
    try:
        refs = {name: outputs(ref, "overlap", ps, p) for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}
    finally:
        ref.shutdown()
    for pp in (2, 3):
        llm = LLM(path, pp_size=pp, **ENGINE)
        try:
            depths = watch_depth(llm, monkeypatch)
            for loop in ("overlap", "serial"):          # "overlap" runs the PP loop when pp_size > 1
                for name, p in (("greedy", GREEDY), ("seeded", SEEDED)):
                    assert outputs(llm, loop, ps, p) == refs[name], (pp, loop, name)
            assert max(depths) == pp                    # the PP loop really kept pp micro-batches in flight
        finally:
            llm.shutdown()


def test_torch_kernels_pp2_equals_pp1(three_layers):
    """kernels="torch": the op-by-op layers (their deferred residual travels beside the hidden states)."""
    got = {}
    for pp in (1, 2):
        llm = LLM(three_layers["qwen2"], pp_size=pp, kernels="torch", **ENGINE)
        try:
            got[pp] = outputs(llm, "overlap", prompts(4), GREEDY)
        finally:
            llm.shutdown()
    assert got[2] == got[1]


def test_sampling_options_equal_pp1(three_layers):
    """What the last stage serves beside plain sampling: logprobs and prompt logprobs, penalties (their state
    reads input ids from the last stage's own FutureMap), logit bias, and structured output (its token masks
    go to the last stage after the launch)."""
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, logit_bias={17: 50.0}, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40,
                             structured_outputs={"choice": ["alpha", "beta gamma"]})]
    # The grammar row gets the shortest prompt: its grammar compiles off the loop, so it may join the first
    # prefill step or a later one; were it the longest row, the others' padded attention layout (and so
    # their logprobs' last bits) would depend on that timing (it did once, by 1e-6, on a loaded CI run).
    p = prompts(4)
    ps = [p[1], p[2], p[3], p[0]]
    got = {}
    for pp in (1, 2):
        llm = LLM(three_layers["llama-q8_0"], pp_size=pp, **ENGINE)
        try:
            llm.engine.config = llm.engine.config.replace(scheduler="overlap")
            outs = llm.generate(ps, params, use_tqdm=False)
            assert_no_leaks(llm)
            got[pp] = [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs, o.finish_reason) for o in outs]
        finally:
            llm.shutdown()
    assert got[2] == got[1]
    assert got[2][3][3] == "stop"                       # the grammar completed


def test_smollm2_two_three_and_five_stages_equal_one():
    """The real model (30 layers: 15, 10 or 6 a stage) in the default mode: Q4_1 blocks, int8 activations,
    bf16 KV."""
    ps = [[1, 504, 3458, 282, 4649, 314], [1, 1978, 253, 1346, 563, 2079, 28, 357, 3249], [1] + [2000 + i for i in
                                                                                              range(40)]]
    params = (SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.8, seed=3, max_tokens=8))
    got = {}
    for pp in (1, 2, 3, 5):
        llm = LLM(pp_size=pp, device_threads=1, kv_cache_tokens=2048, max_running_requests=8, poison_future_map=True)
        try:
            got[pp] = [outputs(llm, "overlap", ps, p) for p in params]
        finally:
            llm.shutdown()
    assert got[2] == got[1] and got[3] == got[1] and got[5] == got[1]


def test_chunked_pipeline_equals_pp1(three_layers, monkeypatch):
    """Prompts of 200-460 tokens in chunks of 64: a prompt's next chunk is launched while its previous one
    is still on a later stage, and the tokens are PP 1's."""
    ps = [[9 + (13 * i + 7 * j) % 30000 for j in range(200 + 130 * i)] for i in range(3)] + prompts(3)
    engine = {**ENGINE, "max_prefill_tokens": 64, "mixed_prefill_tokens": 64}
    ref = LLM(three_layers["llama-q8_0"], **engine)
    try:
        want = outputs(ref, "overlap", ps, GREEDY)
    finally:
        ref.shutdown()
    llm = LLM(three_layers["llama-q8_0"], pp_size=3, **engine)
    try:
        depths = watch_depth(llm, monkeypatch)
        assert outputs(llm, "overlap", ps, GREEDY) == want
        assert depths.chunked > 0                     # one prompt's chunks were in two micro-batches at once
    finally:
        llm.shutdown()


def test_retraction_with_micro_batches_in_flight(tiny_llama, make_llm, monkeypatch):
    """A KV cache too small for all requests: PP 2 retracts (host truth first: every micro-batch in flight
    is processed) and resumes them, with the outputs of a cache that holds them all, and no leak."""
    ps = [[7 + i] * (20 + 3 * i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = [o.token_ids for o in make_llm(tiny_llama, kv_cache_tokens=8192).generate(ps, params, use_tqdm=False)]
    small = make_llm(tiny_llama, pp_size=2, kv_cache_tokens=300, device_threads=1)
    depths = watch_depth(small, monkeypatch)
    for loop in ("overlap", "serial"):
        assert outputs(small, loop, ps, params) == big
        assert small.engine.scheduler.retractions > 0
    assert max(depths) == 2


def test_aborts_with_micro_batches_in_flight(tiny_llama, make_llm, monkeypatch):
    """Aborts arrive while both micro-batches are in flight: the aborted requests end at once or when their
    micro-batch is processed, the others keep their tokens, nothing leaks (run_script checks)."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    initial = [(name, [5 + i] * (8 + 3 * i), greedy) for i, name in enumerate("abcdef")]
    one = make_llm(tiny_llama)
    full = run_script(one, "overlap", initial, {})
    llm = make_llm(tiny_llama, pp_size=2, device_threads=1)
    depths = watch_depth(llm, monkeypatch)
    out = run_script(llm, "overlap", initial, {4: [("abort", "b")], 7: [("abort", "c"), ("abort", "f")]})
    assert max(depths) == 2
    for label in "ade":
        assert out[label] == full[label]
    for label in "bcf":
        toks, reason = out[label]
        assert reason == "abort" and toks == full[label][0][:len(toks)] and len(toks) < 30


def test_what_stages_cannot_serve_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"pp_size 3 does not fit .*it has 2 layers.*1\.\.2"):
        LLM(tiny_llama, pp_size=3, device_threads=1)
    with pytest.raises(ValueError, match="pp_size 2 with tp_size 2.*not supported"):
        EngineConfig(pp_size=2, tp_size=2)
    with pytest.raises(ValueError, match="pp_size > 1 with speculative_config is not supported"):
        EngineConfig(pp_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="device_backend must be 'process' or 'auto'"):
        EngineConfig(pp_size=2, device_backend="inline")
    with pytest.raises(ValueError, match="pp_size must be >= 1"):
        EngineConfig(pp_size=0)
    with pytest.raises(ValueError, match="pp_size 3 device ranks do not split evenly over 2 nodes"):
        EngineConfig(pp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1")


def test_trace_shows_the_pipeline(tiny_llama, tmp_path):
    """`tandem trace --pp 2`'s recording: every step has both stages' own spans, in pipeline order; the
    summary has each stage's busy and send ms and bubble fraction; trace.json has a track per stage and
    report.html their table."""
    import json

    from tandem.trace.export import write_trace_dir
    from tandem.trace.run import Workload, trace_loops
    from tandem.trace.summary import summarize
    llm = LLM(tiny_llama, pp_size=2, device_threads=1, kv_cache_tokens=4096)
    try:
        recs, tps = trace_loops(llm, Workload(requests=8, max_tokens=8, input_len=16))
    finally:
        llm.shutdown()
    rec = {r.loop: r for r in recs}["overlap"]            # the PP loop under pp_size 2
    assert rec.devices and all([k for k, *_ in d.stages] == [0, 1] for d in rec.devices)
    for d in rec.devices:
        (_, s0, e0, _), (_, s1, e1, _) = d.stages
        assert s0 <= e0 and s1 <= e1 and s0 <= s1 and e0 <= e1 <= d.end
    stages = rec.summary["pp_stages"]
    assert [st["stage"] for st in stages] == [0, 1] and all(0 <= st["bubble_fraction"] < 1 for st in stages)
    assert all(st["steps"] == len(rec.devices) and st["comm_ms_per_step"] >= 0 for st in stages)
    paths = write_trace_dir(str(tmp_path / "trace"), recs, summarize(recs, tps), "pp trace")
    names = {e["args"]["name"] for e in json.load(open(paths["trace.json"]))["traceEvents"]
             if e.get("name") == "thread_name"}
    assert {"pipeline stage 0", "pipeline stage 1"} <= names
    assert "pipeline stages" in open(paths["report.html"]).read()


@pytest.mark.parametrize("pp", [2, 4])
def test_two_nodes_on_localhost_equal_one(pp, tmp_path, monkeypatch):
    """Node 1 is a separate `tandem serve --node-rank 1` launch holding the later half of the stages (the last
    one samples there: its results come back through node 0's last stage, the grammar masks go to it); PP 4
    also passes the step from stage to stage on node 1. Q8_0 blocks in the int8 mode: logprobs are equal."""
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    path = str(write_tiny_gguf(tmp_path / "tiny4-q8_0.gguf",
                               make_tiny_model(tmp_path / "tiny4", "llama", num_hidden_layers=4), quant="Q8_0"))
    params = [GREEDY, SEEDED, SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=1,
                                             ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40,
                             structured_outputs={"choice": ["alpha", "beta gamma"]})]
    p = prompts(5)
    ps = [p[4], p[1], p[2], p[3], p[0]]        # the grammar row the shortest (test_sampling_options_equal_pp1)

    def run(llm) -> list:
        outs = llm.generate(ps, params, use_tqdm=False)
        assert_no_leaks(llm)
        return [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs, o.finish_reason) for o in outs]
    ref = LLM(path, **ENGINE)
    try:
        want = run(ref)
    finally:
        ref.shutdown()
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", path, "--pp", str(pp),
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--kv-cache-tokens",
                              "4096", "--max-running-requests", "16", "--device-threads", "1",
                              "--poison-future-map", "--log-level", "warning"])
    try:
        llm = LLM(path, pp_size=pp, nnodes=2, node_rank=0, dist_init_addr=addr, **ENGINE)
        try:
            assert len(llm.engine.executor.conns) == pp // 2          # node 0 runs only its own stages
            depths = watch_depth(llm, monkeypatch)
            assert run(llm) == want
            assert max(depths) == pp
            if pp == 2:                                 # node 1 dies: an error on node 0, not a hang
                from tandem.device.process.executor import DeviceProcessError
                node1.kill()
                node1.wait()
                with pytest.raises(DeviceProcessError):
                    llm.generate(ps, GREEDY, use_tqdm=False)
                s = llm.engine.scheduler                # the engine is unusable now: clean books for shutdown
                for req in list(s.running):
                    s.finish(req, "abort")
                s.result_queue.clear()
        finally:
            llm.shutdown()
        if pp != 2:
            assert node1.wait(timeout=30) == 0          # the quit passed around the pipeline ends node 1 cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.parametrize("stage", [0, 1])
def test_killed_stage_is_an_error_not_a_hang(stage, tiny_llama, make_llm):
    """Stage 0 (its neighbour's recv fails: the error names the stage that died) or the sampling stage."""
    from tandem.device.process.executor import DeviceProcessError
    llm = make_llm(tiny_llama, pp_size=2, device_threads=1)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    runner = llm.engine.executor
    (runner.proc if stage == 0 else runner.ranks[0]).kill()
    with pytest.raises(DeviceProcessError, match=f"pipeline stage {stage} died"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    s = llm.engine.scheduler                            # the engine is unusable now: clean books for the check
    for req in list(s.running):
        s.finish(req, "abort")
    s.result_queue.clear()


def pp_server(path: str, tmp_path) -> ServerProcess:
    return ServerProcess(["--model", path, "--pp", "2", "--kv-cache-tokens", "8192", "--device-threads", "1"],
                         str(tmp_path / "server.log"))


def disconnect_mid_stream(srv: ServerProcess) -> None:
    """Four long streams keep both micro-batches busy; one client leaves mid-stream: its request is aborted,
    the others finish, and every KV slot comes back."""
    import threading

    def aborts() -> float:
        return sum(v for k, v in srv.metrics().items() if k.startswith("tandem:request_success_total")
                   and 'finished_reason="abort"' in k)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    before, done = aborts(), []
    others = [threading.Thread(target=lambda: done.append(httpx.post(
        srv.url + "/v1/completions", json=body, timeout=120, trust_env=False).status_code)) for _ in range(3)]
    for t in others:
        t.start()
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break                           # closing the connection aborts the request
    for t in others:
        t.join(120)
    assert done == [200, 200, 200]
    srv.wait_metric("tandem:num_requests_running", lambda v: v == 0.0)
    assert aborts() == before + 1
    assert srv.wait_metric("tandem:kv_cache_usage_perc", lambda v: v == 0.0) == 0.0


def test_pp_server_streams_offline_tokens_and_sigterm_leaves_nothing(tiny_llama, tmp_path):
    """`tandem serve --pp 2`: frontend, engine and two stage processes; a streamed completion carries PP 1's
    offline tokens; a client that leaves mid-stream frees its KV; SIGTERM exits 0 and leaves no process or
    shared-memory folder."""
    ref = LLM(tiny_llama, kv_cache_tokens=8192, device_threads=1)
    try:
        want = ref.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].text
    finally:
        ref.shutdown()
    srv = pp_server(tiny_llama, tmp_path)
    pids = process_tree(srv.proc.pid)
    assert len(pids) == 4, pids                         # frontend, engine, stage 0 and stage 1
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as h:
        with h.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                       "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want
    disconnect_mid_stream(srv)
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert wait_gone(pids) == []
    assert runtime_dirs(*pids) == []


def test_pp_stage_death_is_503_and_exit_1(tiny_llama, tmp_path):
    assert_rank_death_is_503(pp_server(tiny_llama, tmp_path), b"tandem.device.process.main", ranks=2)
