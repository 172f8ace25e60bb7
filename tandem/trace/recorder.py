"""The recorder: host spans of every loop iteration and the device span of every forward.

Cheap by design (a perf_counter pair and a tuple per span, in bounded rings), so a live server can keep it
on. From the spans: device busy and idle time, and the device idle fraction of a run.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Iterator

from ..device.streams import now

HOST_SPANS = ("recv", "pick", "launch", "process", "wait", "mask", "propose")


@dataclass(frozen=True)
class DeviceSpan:
    step: int
    start: float
    end: float
    batch_size: int
    num_tokens: int
    is_prefill: bool
    launch: float
    comm: float = 0.0        # seconds of the forward in tensor-parallel collectives (all-reduce, gather, broadcast)
    draft_tokens: int = 0    # speculative decoding: drafts this forward verified (0: not a verify step)
    stages: tuple = ()       # pipeline stages on node 0: ((stage, busy start, end, seconds in sends), ...)


class Recorder:
    def __init__(self, enabled: bool = True, loop: str = "", ring_steps: int | None = None) -> None:
        self.enabled = enabled
        self.loop = loop
        maxlen = None if ring_steps is None else ring_steps * 8
        self.host: collections.deque[tuple[str, int, float, float]] = collections.deque(maxlen=maxlen)
        self.devices: collections.deque[DeviceSpan] = collections.deque(maxlen=ring_steps)
        self._launch: dict[int, float] = {}
        self.output_tokens = 0
        self.appended = 0          # host spans ever appended (the ring's length stops growing when full)

    @contextlib.contextmanager
    def _span(self, name: str, step: int) -> Iterator[None]:
        start = now()
        try:
            yield
        finally:
            self.host.append((name, step, start, now()))
            self.appended += 1

    def span(self, name: str, step: int = -1):
        return self._span(name, step) if self.enabled else contextlib.nullcontext()

    def drop_since(self, mark: int) -> None:
        """Forget the host spans of an iteration that scheduled nothing (an idle server polls every 50 ms)."""
        for _ in range(min(self.appended - mark, len(self.host))):
            self.host.pop()
        self.appended = mark

    def launched(self, batch) -> None:
        if self.enabled:
            self._launch[batch.step_id] = now()

    def device(self, batch, span: tuple[float, float], output_tokens: int, comm_s: float = 0.0,
               stages: tuple = ()) -> None:
        """The step's forward span, and the tokens its processing kept (dropped one-step-lag tokens excluded).
        Under pipeline parallelism the span runs from the last stage's launch to its end, and `stages` has
        each stage's own busy span."""
        if not self.enabled:
            return
        launch = self._launch.pop(batch.step_id, span[0])
        self.devices.append(DeviceSpan(batch.step_id, span[0], span[1], batch.size, batch.num_tokens,
                                       batch.is_prefill, launch, comm_s,
                                       int(batch.step.draft_lens[batch.step.draft_lens > 0].sum()), stages))
        self.output_tokens += output_tokens

    def clear(self) -> None:
        self.host.clear()
        self.devices.clear()
        self._launch.clear()
        self.output_tokens = 0

    def summary(self, wall_s: float | None = None, output_tokens: int | None = None) -> dict:
        dev = sorted(self.devices, key=lambda d: d.start)
        steps = len(dev)
        busy = busy_time(dev)
        window = (max(d.end for d in dev) - dev[0].start) if dev else 0.0     # the last to start may end first
        host_total = sum(e - s for n, _, s, e in self.host if n in ("recv", "pick", "launch", "process"))
        waited = sum(e - s for n, _, s, e in self.host if n == "wait")
        wall = wall_s if wall_s is not None else window
        out = self.output_tokens if output_tokens is None else output_tokens
        return {
            "loop": self.loop,
            "device_idle_fraction": (1.0 - busy / window) if window > 0 else 0.0,
            "steps": steps,
            "wall_s": wall,
            "output_tokens": out,
            "tokens_per_s": out / wall if wall > 0 else 0.0,
            "host_ms_per_step": 1e3 * (host_total - waited) / steps if steps else 0.0,
            "device_ms_per_step": 1e3 * busy / steps if steps else 0.0,
            "comm_ms_per_step": 1e3 * sum(d.comm for d in dev) / steps if steps else 0.0,
            **({"pp_stages": stage_summary(dev)} if any(d.stages for d in dev) else {}),
        }


def busy_time(spans) -> float:
    """Seconds covered by the device spans (with .start, .end): an urgent step runs inside the span of the step it
    was run in (scheduler/urgent.py), so their union, not their sum."""
    busy, reach = 0.0, float("-inf")
    for d in sorted(spans, key=lambda d: d.start):
        if d.end > reach:
            busy += d.end - max(d.start, reach)
            reach = d.end
    return busy


def stage_summary(dev: list[DeviceSpan]) -> list[dict]:
    """Per pipeline stage: busy and send ms per step, and its bubble fraction, the share of the pipeline's
    window (first stage start to last stage end) the stage spent without a micro-batch."""
    per: dict[int, list[tuple[float, float, float]]] = {}
    for d in dev:
        for k, s, e, c in d.stages:
            per.setdefault(k, []).append((s, e, c))
    if not per:
        return []
    t0 = min(s for spans in per.values() for s, _, _ in spans)
    window = max(e for spans in per.values() for _, e, _ in spans) - t0
    out = []
    for k in sorted(per):
        busy, n = sum(e - s for s, e, _ in per[k]), len(per[k])
        out.append({"stage": k, "steps": n, "busy_ms_per_step": 1e3 * busy / n,
                    "comm_ms_per_step": 1e3 * sum(c for _, _, c in per[k]) / n,
                    "bubble_fraction": 1.0 - busy / window if window > 0 else 0.0})
    return out
