"""The adaptive rule's row cost is measured from the device time of decode steps (speculative.observe_step):
draft-free steps give t(B) per batch size, verify steps of B requests and R rows the cost of one more row."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tandem.scheduler import speculative as spec


def _sched() -> SimpleNamespace:
    return SimpleNamespace(row_cost=spec.ROW_COST, plain_step_s={}, max_verify_rows=64)


def _lens(requests: int, drafts: int) -> np.ndarray:
    """draft_lens of a step: the first request drafts `drafts` rows (k at its head row, -1 at its drafts)."""
    if not drafts:
        return np.zeros(requests, np.int64)
    return np.array([drafts] + [-1] * drafts + [0] * (requests - 1), np.int64)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_row_cost_converges_to_the_measured_one(batch):
    s, t1, c = _sched(), 0.010, 0.07
    step = lambda rows: t1 * (1 + c * (rows - 1))          # noqa: E731  the model observe_step assumes
    spec.observe_step(s, _lens(batch, 4), step(batch + 4))
    assert s.row_cost == spec.ROW_COST                      # no draft-free step of this size seen yet
    for _ in range(40):
        spec.observe_step(s, _lens(batch, 0), step(batch))
        spec.observe_step(s, _lens(batch, 4), step(batch + 4))
    assert s.row_cost == pytest.approx(c, rel=1e-4)
    assert set(s.plain_step_s) == {batch}


def test_outliers_are_clipped():
    s = _sched()
    spec.observe_step(s, _lens(1, 0), 0.010)
    spec.observe_step(s, _lens(1, 4), 0.005)                # faster than a plain step: the floor
    lo = s.row_cost
    assert spec.ROW_COST_RANGE[0] < lo < spec.ROW_COST
    for _ in range(30):
        spec.observe_step(s, _lens(1, 4), 1.0)              # a stalled step: the ceiling
    assert s.row_cost == pytest.approx(spec.ROW_COST_RANGE[1], rel=1e-4)


def test_a_cheaper_row_drafts_longer_runs():
    """draft_len drafts the j-th token while p^j beats the row's cost: a measured cheap row drafts more."""
    cfg = SimpleNamespace(num_speculative_tokens=8, method="ngram")
    req = SimpleNamespace(spec_acc=0.6, spec_trials=1.0, spec_skipped=0, spec_probe_gap=16, spec_probing=False,
                          spec_guess=[], output_ids=[], max_new_tokens=lambda: 100)
    ks = []
    for cost in (0.2, 0.05):
        s = SimpleNamespace(config=SimpleNamespace(speculative_config=cfg), row_cost=cost, drafter=None,
                            decode_step_s=None)
        ks.append(spec.draft_len(s, req, 1))
    assert ks == [3, 5]                                     # 0.6^3 > 0.2 > 0.6^4; 0.6^5 > 0.05 > 0.6^6
