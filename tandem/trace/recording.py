"""The recorded data model: a Recording is a frozen copy of one loop's Recorder rings, and the per-step view of it.

Times stay in seconds on the shared perf_counter clock; every view shifts a loop to its own first span (t = 0) so
loops recorded one after the other line up. Per step k: the host iteration that launched k (recv, pick batch,
launch step k and whatever results it processed: k in the serial loop, k-1 in the overlap loop), and the device
forward k, from its launch to its end.
"""
from __future__ import annotations

from dataclasses import dataclass

from .recorder import DeviceSpan, Recorder

HostSpan = tuple[str, int, float, float]      # (name, step, start, end); step -1 for recv and pick


@dataclass(frozen=True)
class Recording:
    loop: str
    host: tuple[HostSpan, ...]            # sorted by start; "wait" nests inside its "process"
    devices: tuple[DeviceSpan, ...]       # sorted by step (= by start: the device runs steps in order)
    summary: dict

    @classmethod
    def take(cls, rec: Recorder, wall_s: float | None = None, output_tokens: int | None = None) -> "Recording":
        return cls(rec.loop, tuple(sorted(rec.host, key=lambda h: (h[2], -h[3]))),
                   tuple(sorted(rec.devices, key=lambda d: d.step)), rec.summary(wall_s, output_tokens))

    @property
    def t0(self) -> float:
        starts = [h[2] for h in self.host] + [d.launch for d in self.devices]
        return min(starts) if starts else 0.0


@dataclass(frozen=True)
class StepRow:
    step: int
    is_prefill: bool
    batch_size: int
    num_tokens: int
    start_ms: float       # start of the host iteration that launched this step (from the loop's t0)
    host_ms: float        # host busy time of that iteration (waits on copy_done excluded)
    wait_ms: float        # host time blocked on copy_done in that iteration
    device_ms: float      # forward k
    idle_ms: float        # device idle right before forward k: since forward k-1 ended (step 0: since launch)
    draft_tokens: int = 0 # speculative decoding: drafts forward k verified


def iterations(rec: Recording) -> list[tuple[int, list[HostSpan]]]:
    """Split host spans into loop iterations (each starts with recv), keyed by the step each launched.

    Iterations that launch nothing (the overlap loop's final flush) join the one before; idle spins before
    the first launch are dropped.
    """
    out: list[tuple[int, list[HostSpan]]] = []
    cur: list[HostSpan] = []

    def close() -> None:
        launched = [h[1] for h in cur if h[0] == "launch"]
        if launched:
            out.append((launched[0], list(cur)))
        elif out and any(h[0] == "process" for h in cur):
            out[-1][1].extend(cur)

    for h in rec.host:
        if h[0] == "recv" and cur:
            close()
            cur = []
        cur.append(h)
    close()
    return out


def step_rows(rec: Recording) -> list[StepRow]:
    t0, iters = rec.t0, {k: spans for k, spans in iterations(rec)}
    rows, prev_end = [], None
    for d in rec.devices:
        spans = iters.get(d.step, [])
        wait = sum(e - s for n, _, s, e in spans if n == "wait")
        busy = sum(e - s for n, _, s, e in spans if n != "wait") - wait
        idle = d.start - (prev_end if prev_end is not None else d.launch)
        rows.append(StepRow(d.step, d.is_prefill, d.batch_size, d.num_tokens,
                            1e3 * ((spans[0][2] if spans else d.launch) - t0), 1e3 * busy, 1e3 * wait,
                            1e3 * (d.end - d.start), 1e3 * max(idle, 0.0), d.draft_tokens))
        prev_end = d.end
    return rows


def idle_gaps(rec: Recording) -> list[tuple[float, float]]:
    """Device idle intervals between the first forward's start and the last forward's end."""
    gaps, prev = [], None
    for d in rec.devices:
        if prev is not None and d.start > prev:
            gaps.append((prev, d.start))
        prev = d.end if prev is None else max(prev, d.end)
    return gaps
