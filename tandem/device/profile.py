"""A per-op profile of the device's decode steps, for the benchmarks (`benchmarks/decode_profile.py`).

Set TANDEM_DEVICE_PROFILE=out.json (and optionally TANDEM_DEVICE_PROFILE_SKIP=N, default 8, and
TANDEM_DEVICE_PROFILE_STEPS=M, default 48) in the environment of a process that starts a CPU device process:
after N decode steps (every row one new token) it runs torch.profiler over the next M decode steps (or fewer,
if the run ends first) and then writes
  {"steps", "other_steps_while_profiling", "batch_sizes", "wall_ms_per_step", "ops": [{"name", "calls_per_step", "self_ms_per_step"}],
   "ops_ms_per_step", "other_ms_per_step"}
where `other` is the step's wall time outside every profiled op's own time: Python, op dispatch and the
profiler's own cost (an upper bound on the first two). Off by default; nothing else reads it.
"""
from __future__ import annotations

import contextlib
import json
import os
import time


DEFAULT_SKIP, DEFAULT_STEPS = 8, 48    # decode steps before the profiler starts, and profiled


class DeviceProfile:
    def __init__(self, path: str, skip: int = DEFAULT_SKIP, steps: int = DEFAULT_STEPS) -> None:
        # The profile is written once `steps` steps are in (not only at quit): the device process gets
        # 10 s to exit at shutdown, less than key_averages takes over a few hundred large steps here.
        self.path, self.skip, self.steps = path, skip, steps
        self.done = False
        self.seen = 0                 # decode steps so far
        self.walls: list[float] = []
        self.batch_sizes: set[int] = set()
        self.mixed_in = 0             # other steps run while profiling (the caller should keep this 0)
        self.prof = None

    @staticmethod
    def from_env() -> "DeviceProfile | None":
        path = os.environ.get("TANDEM_DEVICE_PROFILE")
        if not path:
            return None
        return DeviceProfile(path, int(os.environ.get("TANDEM_DEVICE_PROFILE_SKIP", DEFAULT_SKIP)),
                             int(os.environ.get("TANDEM_DEVICE_PROFILE_STEPS", DEFAULT_STEPS)))

    @contextlib.contextmanager
    def step(self, batch_size: int, num_tokens: int):
        decode = num_tokens == batch_size
        self.seen += decode
        if self.done or not decode or self.seen <= self.skip:
            self.mixed_in += self.prof is not None and not self.done   # profiled too: the figures would be off
            yield
            return
        if self.prof is None:
            import torch.profiler
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        t = time.perf_counter()
        yield
        self.walls.append(time.perf_counter() - t)
        self.batch_sizes.add(batch_size)
        if len(self.walls) >= self.steps:
            self.write()

    def write(self) -> None:
        if self.prof is None or self.done:
            return
        self.done = True
        self.prof.__exit__(None, None, None)
        n = len(self.walls)
        # Self times exclude the ops called inside: their sum counts each microsecond once.
        ops = [{"name": e.key, "calls_per_step": e.count / n, "self_ms_per_step": e.self_cpu_time_total / 1e3 / n}
               for e in self.prof.key_averages() if e.self_cpu_time_total > 0]
        ops.sort(key=lambda o: -o["self_ms_per_step"])
        wall = sum(self.walls) / n * 1e3
        in_ops = sum(o["self_ms_per_step"] for o in ops)
        with open(self.path, "w") as f:
            json.dump({"steps": n, "other_steps_while_profiling": self.mixed_in, "batch_sizes": sorted(self.batch_sizes), "wall_ms_per_step": wall, "ops": ops,
                       "ops_ms_per_step": in_ops, "other_ms_per_step": wall - in_ops}, f, indent=1)
