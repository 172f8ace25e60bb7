"""Recordings out: Chrome trace JSON (Perfetto, chrome://tracing) and the trace folder (summary.json, trace.json,
timeline.png, report.html). Each loop is shifted to its own first span (t = 0) so loops recorded one after the
other line up.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from .recorder import Recorder
from .recording import Recording, idle_gaps
from .summary import summarize

HOST_NAMES = {"recv": "recv", "pick": "pick batch", "launch": "launch step", "process": "process results",
              "wait": "wait copy_done", "mask": "grammar masks",
              "propose": "propose drafts"}
PID = {"serial": 1, "overlap": 2}
HOST_TID, DEVICE_TID, IDLE_TID = 1, 2, 3
STAGE_TID = 10               # pipeline stage k's track: STAGE_TID + k


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


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_trace_dir(out_dir: str, recs: list[Recording], summary: dict, title: str) -> dict[str, str]:
    """Write summary.json, trace.json, timeline.png and report.html into out_dir; returns their paths."""
    from .report import write_report          # matplotlib loads only where a folder is written
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
