"""ModelRunner.run returns each step's results as its own ForwardOutput (ids, logprobs, prompt logprobs,
embeddings), not as state on the model runner: a step run between two layers of another (an urgent step) gets
its own record, and the other's is whole after it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tandem.device.model_runner import ForwardOutput
from tests.device.test_nested_steps import models, prefill, runner  # noqa: F401 (models: a fixture)


def test_each_step_returns_its_own_record(models):
    r = runner(*models["torch"])
    long = dataclasses.replace(prefill(1, [1, 2], [0, 0], [24, 5], [0, 60]), num_logprobs=np.array([3, -1]))
    urgent = prefill(2, [3], [0], [10], [100])
    inner = []

    def between(layer: int) -> None:
        if layer == 1:
            with r.nested():
                inner.append(r.run(urgent))
    out = r.run(long, between=between)
    assert isinstance(out, ForwardOutput) and out.tokens.shape == (2,)
    assert out.logprobs is not None and out.logprobs.chosen.shape == (2,) and out.logprobs.top_ids.shape[0] == 2
    assert out.prompt_logprobs is None and out.embeddings is None
    (first,) = inner
    assert first.tokens.shape == (1,) and first.logprobs is None
    assert not any(name.startswith("last_") for name in vars(r))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.tokens = torch.zeros(2)
    assert torch.equal(r.run_step(prefill(3, [4], [0], [6], [140])), r.seen[-1].argmax(-1))   # greedy ids alone
