"""Recordings out: Chrome trace JSON (Perfetto, chrome://tracing), the per-step table and summary.json.

A Recording is a frozen copy of one loop's Recorder rings. Times stay in seconds on the shared perf_counter
clock; every export shifts a loop to its own first span (t = 0) so loops recorded one after the other line up.
Per step k: the host iteration that launched k (recv, pick batch, launch step k and whatever results it
processed: k in the serial loop, k-1 in the overlap loop), and the device forward k, from its launch to its end.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from statistics import median
from typing import Iterable

from .recorder import DeviceSpan, Recorder

HostSpan = tuple[str, int, float, float]      # (name, step, start, end); step -1 for recv and pick
HOST_NAMES = {"recv": "recv", "pick": "pick batch", "launch": "launch step", "process": "process results",
              "wait": "wait copy_done", "mask": "grammar masks",
              "propose": "propose drafts"}
PID = {"serial": 1, "overlap": 2}
HOST_TID, DEVICE_TID, IDLE_TID = 1, 2, 3
STAGE_TID = 10               # pipeline stage k's track: STAGE_TID + k


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


# ---- Chrome trace -------------------------------------------------------------------------------------------
def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def chrome_trace(recs: Iterable[Recording], meta: dict | None = None) -> dict:
    """Trace event format: one process per loop; host, device and device-idle tracks; step numbers in args."""
    events: list[dict] = []
    for i, rec in enumerate(recs):
        pid, t0 = PID.get(rec.loop, 10 + i), rec.t0
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{rec.loop} loop"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": HOST_TID, "args": {"name": "host (scheduler)"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": DEVICE_TID, "args": {"name": "device"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": IDLE_TID, "args": {"name": "device idle"}},
        ]
        for name, step, s, e in rec.host:
            ev = {"ph": "X", "name": HOST_NAMES.get(name, name), "cat": "host", "pid": pid, "tid": HOST_TID,
                  "ts": _us(s, t0), "dur": round((e - s) * 1e6, 3)}
            if step >= 0:
                ev["args"] = {"step": step}
            events.append(ev)
            if name == "launch":      # a flow arrow from launch step k to forward k
                events.append({"ph": "s", "name": "step", "cat": "flow", "id": pid * 10**7 + step, "pid": pid,
                               "tid": HOST_TID, "ts": _us(s, t0)})
        for d in rec.devices:
            events.append({"ph": "X", "name": "verify" if d.draft_tokens else "forward", "cat": "device",
                           "pid": pid, "tid": DEVICE_TID,
                           "ts": _us(d.start, t0), "dur": round((d.end - d.start) * 1e6, 3),
                           "args": {"step": d.step, "batch_size": d.batch_size, "num_tokens": d.num_tokens,
                                    "prefill": d.is_prefill, "launch_ts": _us(d.launch, t0),
                                    "queued_ms": round(1e3 * (d.start - d.launch), 3),
                                    "tp_comm_ms": round(1e3 * d.comm, 3), "draft_tokens": d.draft_tokens}})
            events.append({"ph": "f", "bp": "e", "name": "step", "cat": "flow", "id": pid * 10**7 + d.step,
                           "pid": pid, "tid": DEVICE_TID, "ts": _us(d.start, t0)})
        for s, e in idle_gaps(rec):
            events.append({"ph": "X", "name": "idle", "cat": "idle", "pid": pid, "tid": IDLE_TID,
                           "ts": _us(s, t0), "dur": round((e - s) * 1e6, 3)})
        events += stage_events(rec, pid, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}


def stage_events(rec: Recording, pid: int, t0: float) -> list[dict]:
    """The pipeline view: one track per stage with its micro-batches (step ids in args); the gaps between
    them are that stage's bubbles."""
    events, named = [], set()
    for d in rec.devices:
        for k, s, e, comm in d.stages:
            if k not in named:
                named.add(k)
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": STAGE_TID + k,
                               "args": {"name": f"pipeline stage {k}"}})
            events.append({"ph": "X", "name": "prefill" if d.is_prefill else "decode", "cat": "stage", "pid": pid,
                           "tid": STAGE_TID + k, "ts": _us(s, t0), "dur": round((e - s) * 1e6, 3),
                           "args": {"step": d.step, "batch_size": d.batch_size, "send_ms": round(1e3 * comm, 3)}})
    return events


# ---- summary ------------------------------------------------------------------------------------------------
def summarize(recs: list[Recording], tokens_per_s_rounds: dict[str, list[float]] | None = None, **meta) -> dict:
    """Per-loop Recorder summaries, plus overlap/serial tokens/s and its bound from the serial run's spans."""
    loops = {r.loop: dict(r.summary) for r in recs}
    for loop, tps in (tokens_per_s_rounds or {}).items():
        if loop in loops and len(tps) > 1:
            loops[loop]["tokens_per_s_rounds"] = tps
            loops[loop]["tokens_per_s_median"] = median(tps)
    out: dict = dict(meta)
    out["loops"] = loops
    if "serial" in loops and "overlap" in loops:
        def tps(loop: str) -> float:
            return loops[loop].get("tokens_per_s_median", loops[loop]["tokens_per_s"])
        h, d = loops["serial"]["host_ms_per_step"], loops["serial"]["device_ms_per_step"]
        out["overlap_speedup"] = tps("overlap") / tps("serial") if tps("serial") > 0 else 0.0
        # Ideal overlap: the step shrinks from host + device to the longer of the two.
        out["overlap_speedup_bound"] = (h + d) / max(h, d) if max(h, d) > 0 else 1.0
        out["overlap_speedup_check"] = speedup_check(out["overlap_speedup"], out["overlap_speedup_bound"])
    return out


BOUND_SLACK = 0.05       # rounds on a shared machine drift by a few percent: beyond that, a figure is suspect


def speedup_check(speedup: float, bound: float) -> str:
    """"ok", or why a speedup above its own bound cannot be a real one: the loops were not measured alike
    (a warm-up or a cache inside one loop's recording, or load on the machine during one of them)."""
    if speedup <= bound * (1 + BOUND_SLACK):
        return "ok"
    return (f"the speedup {speedup:.2f} exceeds its bound {bound:.2f}: the loops were not measured alike "
            f"(warm-up, cache or foreign load inside one recording); rerun with more --rounds")


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_trace_dir(out_dir: str, recs: list[Recording], summary: dict, title: str) -> dict[str, str]:
    """Write summary.json, trace.json, timeline.png and report.html into out_dir; returns their paths."""
    from .report import write_report
    from .timeline import plot_timelines
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("summary.json", "trace.json", "timeline.png", "report.html")}
    write_json(paths["summary.json"], summary)
    write_json(paths["trace.json"], chrome_trace(recs, {"title": title, "summary": summary}))
    plot_timelines(recs, paths["timeline.png"])
    write_report(paths["report.html"], recs, summary, paths["timeline.png"], title)
    return paths


def write_live_trace(recorder: Recorder, trace_dir: str, model_name: str) -> dict[str, str]:
    """Engine.shutdown() hook: export the ring of the one loop a live run recorded."""
    rec = Recording.take(recorder)
    summary = summarize([rec], model=model_name, source="live", ring_steps=recorder.devices.maxlen)
    return write_trace_dir(trace_dir, [rec], summary, f"tandem live trace: {model_name}, {rec.loop} loop")
