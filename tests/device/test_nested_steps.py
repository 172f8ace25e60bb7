"""Urgent steps on the device side (scheduler/urgent.py): a step run between two layers of another, in
ModelRunner.nested(), leaves both with the bits they have when run one after the other (KV written, logits), on
the torch layers and on the native ones; and the device process's step loop runs an urgent launch that comes while
a yielding step runs there, keeping every other message for after it."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tandem.config import EngineConfig
from tandem.device.model_runner import ModelRunner
from tandem.device.process import main
from tandem.device.ranks import runner_spec
from tandem.device.step import StepInput
from tandem.model.loader import resolve_model
from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = make_tiny_model(tmp_path_factory.mktemp("nested-hf"), "llama")
    q8 = write_tiny_gguf(tmp_path_factory.mktemp("nested-q8") / "tiny-q8_0.gguf", hf, quant="Q8_0")
    return {"torch": (hf, "torch"), "native": (q8, "native")}


def prefill(step_id: int, rows: list[int], starts: list[int], lens: list[int], first_slot: list[int]) -> StepInput:
    """A greedy step of prefill chunks: row i computes positions [starts[i], starts[i] + lens[i]) into KV slots
    from first_slot[i] on (its earlier positions were written by an earlier step)."""
    n, rng = len(rows), np.random.default_rng(step_id)
    ids = np.concatenate([rng.integers(3, 200, size=k) for k in lens])
    locs = np.concatenate([np.arange(f, f + k) for f, k in zip(first_slot, lens)])
    return StepInput(step_id, np.array(rows), np.array(lens), np.array(starts) + np.array(lens), np.zeros(n, np.int64),
                     ids.astype(np.int64), locs.astype(np.int64), np.zeros(n), np.ones(n), np.full(n, -1, np.int64),
                     np.zeros(n), np.zeros(n, np.int64), np.zeros(0, np.int64))


def runner(path: str, kernels: str) -> ModelRunner:
    config = EngineConfig(model=path, kv_cache_tokens=256, max_running_requests=4, device="cpu", kernels=kernels)
    r = ModelRunner(runner_spec(config, resolve_model(config.model)))
    logits = []
    real = r.model.logits
    r.model.logits = lambda h: logits.append(real(h).clone()) or logits[-1]
    r.seen = logits
    return r


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_a_step_run_between_two_layers_of_another_changes_no_bit(models, kind):
    # Both steps attend a prefix written by an earlier step (torch layers: each gathers its keys into a buffer),
    # and the urgent one runs where the long one is between its layers 0 and 1.
    setup = prefill(0, [1, 3], [0, 0], [20, 8], [0, 100])
    long = prefill(1, [1, 2], [20, 0], [24, 5], [20, 60])
    urgent = prefill(2, [3], [8], [10], [108])
    apart, nested = runner(*models[kind]), runner(*models[kind])
    for step in (setup, long, urgent):
        apart.run_step(step)
    nested.run_step(setup)
    ran = []

    def between(layer: int) -> None:
        ran.append(layer)
        if layer == 1:
            with nested.nested():
                nested.run_step(urgent)
    nested.run_step(long, between=between)
    assert ran == list(range(1, nested.config.num_layers))
    # logits: setup, urgent, long (the urgent step ends first) against setup, long, urgent
    seen, ref = nested.seen, apart.seen
    assert torch.equal(seen[0], ref[0]) and torch.equal(seen[1], ref[2]) and torch.equal(seen[2], ref[1])
    used = np.concatenate([np.arange(0, 44), np.arange(60, 65), np.arange(100, 118)])
    assert torch.equal(nested.kv_cache.data[used], apart.kv_cache.data[used])


class FakeConn:
    def __init__(self, messages):
        self.messages = list(messages)

    def poll(self, timeout):
        return bool(self.messages)

    def recv_bytes(self):
        return self.messages.pop(0)


class FakeRunner:
    def __init__(self):
        self.depth = 0

    @contextlib.contextmanager
    def nested(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def test_the_step_loop_runs_an_urgent_launch_between_layers_and_keeps_the_rest():
    messages = [main._LAUNCH.pack(b"M", 5, 1), main._LAUNCH.pack(b"U", 7, 2), main._LAUNCH.pack(b"L", 8, 0), b"Q"]
    fake = FakeRunner()
    loop = main._StepLoop(FakeConn(messages), None, None, fake, None, None, None, None, None)
    ran = []
    loop.launched = lambda step_id, buf, start, yields=False: ran.append((step_id, buf, fake.depth, loop.nested))
    loop.between(1)
    assert ran == [(7, 2, 1, True)] and not loop.nested and fake.depth == 0
    assert loop.early == {5} and list(loop.later) == messages[2:]
    # b"Y" launches a step that yields; a b"U" read by the loop itself (its long step had ended) runs as any
    ran.clear()
    loop.launched = lambda step_id, buf, start, yields=False: ran.append((step_id, yields))
    loop.handle(main._LAUNCH.pack(b"Y", 9, 0))
    loop.handle(main._LAUNCH.pack(b"U", 10, 1))
    assert ran == [(9, True), (10, False)]
