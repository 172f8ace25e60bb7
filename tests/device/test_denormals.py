"""A device process flushes denormals (device/denormals.py) on every thread of its pool: set before the first
parallel region, the pool's workers inherit it, so a tensor spread over them comes back flushed everywhere."""
from __future__ import annotations

import subprocess
import sys

CHECK = """
import torch
from tandem.device.denormals import flush_denormals
flush_denormals()
torch.set_num_threads(2)
x = torch.full((1 << 22,), 1e-39)         # a denormal: read as 0 under DAZ, in every thread's chunk
print(int((x * 3.0).count_nonzero()), int((torch.full((1 << 22,), 1e-30) * 3.0).count_nonzero()))
"""


def test_every_worker_thread_flushes_denormals():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", str(1 << 22)]
