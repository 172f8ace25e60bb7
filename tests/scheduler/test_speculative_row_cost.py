"""The adaptive rule's row cost is measured from the device time of decode steps (Speculation.observe_step):
draft-free steps give t(B) per batch size, verify steps of B requests and R rows the cost of one more row."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tandem.speculative import speculation as spec
from tandem.speculative.speculation import Speculation
from tandem.request import SpecState


def _sched() -> Speculation:
    return Speculation(max_verify_rows=64)


def _lens(requests: int, drafts: int) -> np.ndarray:
    """draft_lens of a step: the first request drafts `drafts` rows (k at its head row, -1 at its drafts)."""
    if not drafts:
        return np.zeros(requests, np.int64)
    return np.array([drafts] + [-1] * drafts + [0] * (requests - 1), np.int64)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_row_cost_converges_to_the_measured_one(batch):
    s, t1, c = _sched(), 0.010, 0.07
    step = lambda rows: t1 * (1 + c * (rows - 1))          # noqa: E731  the model observe_step assumes
    s.observe_step(_lens(batch, 4), step(batch + 4))
    assert s.row_cost == spec.ROW_COST                      # no draft-free step of this size seen yet
    for _ in range(40):
        s.observe_step(_lens(batch, 0), step(batch))
        s.observe_step(_lens(batch, 4), step(batch + 4))
    assert s.row_cost == pytest.approx(c, rel=1e-4)
    assert set(s.plain_step_s) == {batch}


def test_outliers_are_clipped():
    s = _sched()
    s.observe_step(_lens(1, 0), 0.010)
    s.observe_step(_lens(1, 4), 0.005)                # faster than a plain step: the floor
    lo = s.row_cost
    assert spec.ROW_COST_RANGE[0] < lo < spec.ROW_COST
    for _ in range(30):
        s.observe_step(_lens(1, 4), 1.0)              # a stalled step: the ceiling
    assert s.row_cost == pytest.approx(spec.ROW_COST_RANGE[1], rel=1e-4)


def test_a_cheaper_row_drafts_longer_runs():
    """draft_len drafts the j-th token while p^j beats the row's cost: a measured cheap row drafts more."""
    cfg = SimpleNamespace(num_speculative_tokens=8, method="ngram")
    req = SimpleNamespace(spec=SpecState(acc=0.6, trials=1.0, skipped=0, probe_gap=16, probing=False, guess=[]),
                          output_ids=[], max_new_tokens=lambda: 100)
    ks = []
    for cost in (0.2, 0.05):
        s = Speculation(row_cost=cost, drafter=None, decode_step_s=None)
        ks.append(s.draft_len(cfg, req, 1))
    assert ks == [3, 5]                                     # 0.6^3 > 0.2 > 0.6^4; 0.6^5 > 0.05 > 0.6^6
