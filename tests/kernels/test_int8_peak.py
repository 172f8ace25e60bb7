"""The int8 peak probe (torch.ops.tandem.int8_peak, the tiles' yardstick in benchmarks/tile_peak.py): a positive rate
for every body this CPU runs, none for the scalar level, and more multiply-adds a second from the wider body."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.isa import runnable

from tandem import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")


def test_every_body_here_reports_a_rate_and_scalar_none():
    T = torch.ops.tandem
    assert T.int8_peak(1000, 0) == 0.0
    rates = {isa: max(T.int8_peak(20000, isa) for _ in range(3)) for isa in runnable((1, 2), vnni=True)}
    assert all(r > 1e8 for r in rates.values()), rates           # > 0.1 G multiply-adds a second on any CPU
    if 2 in rates:
        assert rates[2] > rates[1], rates                         # 64 products an instruction against 32 in 3
