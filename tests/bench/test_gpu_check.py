"""benchmarks/gpu_check.py without a GPU: it skips clearly where CUDA is missing, and its checks (parity with
transformers through both loops, serial vs overlap, the trace files) run on the CPU with --device cpu."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_check.py")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_skips_without_cuda(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([str(tmp_path)]) == 0
    assert "no CUDA device; skipped" in capsys.readouterr().out
    with open(tmp_path / "gpu_check.json") as f:
        assert json.load(f)["skipped"] == "no CUDA device"


def test_compare_greedy(gpu_check):
    scores = [torch.tensor([0.0, 5.0, 1.0]), torch.tensor([2.0, 2.0 - 1e-4, 0.0]), torch.tensor([3.0, 0.0, 0.0])]
    assert gpu_check.compare_greedy([1, 0, 0], [1, 0, 0], scores)["agree"]
    tie = gpu_check.compare_greedy([1, 1, 2], [1, 0, 0], scores)            # step 1 is a near-tie
    assert tie["agree"] and tie["first_divergence"] == 1
    assert not gpu_check.compare_greedy([2, 0, 0], [1, 0, 0], scores)["agree"]
    assert not gpu_check.compare_greedy([1, 0], [1, 0, 0], scores)["agree"]


def test_checks_run_on_cpu(gpu_check, tiny_llama, tmp_path, capsys):
    argv = [str(tmp_path), "--device", "cpu", "--model", tiny_llama, "--requests", "4", "--max-tokens", "4",
            "--rounds", "1", "--parity-tokens", "6"]
    assert gpu_check.main(argv) == 0
    with open(tmp_path / "gpu_check.json") as f:
        report = json.load(f)
    assert report["parity"]["all_agree"] and len(report["parity"]["overlap"]) == len(gpu_check.PROMPTS)
    assert set(report["loops"]) == {"serial", "overlap"}
    assert all(s["tokens_per_s"] > 0 and 0 <= s["device_idle_fraction"] <= 1 for s in report["loops"].values())
    for name in ("summary.json", "trace.json", "timeline.png", "report.html"):
        assert os.path.getsize(tmp_path / report["trace_files"][name]) > 0
    assert "greedy parity with transformers OK" in capsys.readouterr().out
