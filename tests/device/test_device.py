"""The device-stream abstraction and the step message: importable and testable without a GPU."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tandem.device.step import StepInput
from tandem.device.streams import CompletedEvent, DeviceStreams


def test_cpu_streams_are_synchronous_and_complete():
    streams = DeviceStreams(torch.device("cpu"))
    with streams.forward():
        t = torch.arange(4) * 2
    ev = streams.record()
    host, copy_done = streams.copy_to_host(t)
    assert isinstance(ev, CompletedEvent) and copy_done.query()
    copy_done.wait()
    assert host.tolist() == [0, 2, 4, 6]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_copy_done_gates_the_host_copy():
    dev = torch.device("cuda")
    streams = DeviceStreams(dev)
    with streams.forward():
        a = torch.randn(2048, 2048, device=dev)
        t = (a @ a).sum(dim=1)
    host, copy_done = streams.copy_to_host(t)
    assert host.is_pinned()
    copy_done.wait()
    assert torch.allclose(host, t.cpu())


def test_step_input_pack_round_trip():
    step = StepInput(
        step_id=7, rows=np.array([1, 3]), extend_lens=np.array([3, 1]), seq_lens=np.array([3, 9]),
        use_future=np.array([0, 1]), input_ids=np.array([5, 6, 7, 0]), out_cache_loc=np.array([10, 11, 12, 40]),
        temperature=np.array([0.0, 0.7]), top_p=np.array([1.0, 0.9]), top_k=np.array([-1, 20]),
        min_p=np.array([0.0, 0.1]), draw_seed=np.array([25, 1 << 62]), poison_rows=np.array([4]),
        prefix_lens=np.array([2, 0]), prefix_slots=np.array([70, 71]))
    ints, floats = np.zeros(64, np.int64), np.zeros(16, np.float64)
    step.pack(ints, floats)
    back = StepInput.unpack(7, ints, floats)
    for name in ("rows", "extend_lens", "seq_lens", "use_future", "input_ids", "out_cache_loc", "temperature",
                 "top_p", "top_k", "min_p", "draw_seed", "poison_rows", "prefix_lens", "prefix_slots"):
        assert np.array_equal(getattr(back, name), getattr(step, name)), name


def test_cli_generate(tiny_llama, capsys):
    from tandem.cli import main
    rc = main(["generate", "Hello", "--model", tiny_llama, "--max-tokens", "4", "--kv-cache-tokens", "1024",
               "--scheduler", "serial"])
    assert rc == 0 and capsys.readouterr().out.strip() != ""
    assert main(["generate", "Hello", "--model", tiny_llama, "--max-tokens", "-3",
                 "--kv-cache-tokens", "1024"]) == 2


def test_prefix_cache_and_chunk_flags_reach_the_config():
    from tandem.cli import build_parser, engine_config
    args = build_parser().parse_args(["generate", "x", "--no-prefix-cache", "--mixed-prefill-tokens", "64"])
    config = engine_config(args)
    assert config.prefix_cache is False and config.mixed_prefill_tokens == 64 and config.enable_mixed_chunk


def test_the_device_process_spins_briefly_before_its_workers_sleep(tiny_llm, monkeypatch):
    """The device process starts with ranks.DEVICE_SPINCOUNT as libgomp's spin (so an idle worker yields its core to
    the scheduler sooner), and a GOMP_SPINCOUNT of the user's own wins."""
    from tandem.device.process.executor import ProcessExecutor
    from tandem.device.ranks import DEVICE_SPINCOUNT, device_env
    executor = tiny_llm.engine.executor
    if not isinstance(executor, ProcessExecutor):
        pytest.skip("the engine runs the device inline here")
    with open(f"/proc/{executor.proc.pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert env[b"GOMP_SPINCOUNT"].decode() == os.environ.get("GOMP_SPINCOUNT", DEVICE_SPINCOUNT)
    assert device_env(2)["GOMP_SPINCOUNT"] == os.environ.get("GOMP_SPINCOUNT", DEVICE_SPINCOUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert device_env(2)["GOMP_SPINCOUNT"] == "123"
    assert device_env(3)["OMP_NUM_THREADS"] == "3"
