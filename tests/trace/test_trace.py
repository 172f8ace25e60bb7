"""`tandem trace` and the live --trace path on a tiny model: trace.json, summary.json, timeline.png, report.html.

No wall-clock thresholds: only structure and the ordering invariants of the recorded spans.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import struct

import pytest

from tandem.trace.recording import Recording, idle_gaps, iterations, step_rows
from tandem.trace.summary import speedup_check
from tandem.trace.recorder import DeviceSpan

NODES = ("Pick batch", "Launch step", "Result queue", "Process results", "Device forward", "FutureMap")
REQUESTS, MAX_TOKENS = 4, 6


def run_cli_trace(model: str, out: str, *extra: str) -> int:
    """`tandem trace ...` through the subcommand's own parser (the one tandem.cli registers)."""
    from tandem.trace import cli
    parser = argparse.ArgumentParser(prog="tandem")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", "--model", model, "--requests", str(REQUESTS), "--max-tokens",
                              str(MAX_TOKENS), "--input-len", "8", "--kv-cache-tokens", "4096",
                              "--max-running-requests", "8", "--device-threads", "1", "--out", out, *extra])
    return args.func(args)


@pytest.fixture(scope="module")
def traced(tiny_llama, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("trace"))
    assert run_cli_trace(tiny_llama, out) == 0
    return out


def load(out: str, name: str) -> dict:
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def by_pid(events: list[dict]) -> dict[str, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return {names[p]: [e for e in events if e["pid"] == p and e["ph"] != "M"] for p in names}


# ---- tandem trace -------------------------------------------------------------------------------------------
def test_cli_registers_trace():
    from tandem.cli import build_parser
    args = build_parser().parse_args(["trace", "--out", "x", "--requests", "2"])
    assert args.command == "trace" and args.requests == 2 and args.out == "x"


def test_trace_json_has_both_loops_and_ordered_spans(traced):
    trace = load(traced, "trace.json")
    summary = load(traced, "summary.json")
    loops = by_pid(trace["traceEvents"])
    assert set(loops) == {"serial loop", "overlap loop"}
    for name, evs in loops.items():
        loop = name.split()[0]
        fwd = [e for e in evs if e["name"] == "forward"]
        launches = {e["args"]["step"]: e for e in evs if e["name"] == "launch step"}
        processed = {e["args"]["step"]: e for e in evs if e["name"] == "process results"}
        steps = [e["args"]["step"] for e in fwd]
        assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
        assert len(fwd) == len(launches) == len(processed) == summary["loops"][loop]["steps"] >= MAX_TOKENS
        assert sum(e["args"]["batch_size"] for e in fwd) >= REQUESTS * MAX_TOKENS
        for e in fwd:
            k = e["args"]["step"]
            # Forward k lies inside its step: launched first, then run, then waited on by process results k.
            assert e["args"]["launch_ts"] <= e["ts"] and e["dur"] >= 0
            # Its launch time lies inside its "launch step" span (an ordering, not a wall-clock tolerance: a
            # 50 us one failed on a loaded CI machine).
            lk = launches[k]
            assert lk["ts"] - 1e-3 <= e["args"]["launch_ts"] <= lk["ts"] + lk["dur"] + 1e-3
            assert processed[k]["ts"] + processed[k]["dur"] >= e["ts"] + e["dur"] - 1e-3
            assert e["tid"] != launches[k]["tid"]
        # Forwards run one at a time and in order on the device.
        for a, b in zip(fwd, fwd[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
        # The loops differ in when results are processed: serial processes k before launching k+1,
        # overlap launches k+1 before processing k (except where it flushes at the end).
        later = [launches[k + 1]["ts"] < processed[k]["ts"] for k in steps[:-1] if k + 1 in launches]
        assert (not any(later)) if loop == "serial" else any(later)


def test_summary_numbers(traced):
    s = load(traced, "summary.json")
    for loop in ("serial", "overlap"):
        m = s["loops"][loop]
        for key in ("device_idle_fraction", "steps", "wall_s", "output_tokens", "tokens_per_s",
                    "host_ms_per_step", "device_ms_per_step"):
            assert key in m, key
        assert 0.0 <= m["device_idle_fraction"] <= 1.0
        assert m["output_tokens"] == REQUESTS * MAX_TOKENS and m["tokens_per_s"] > 0
    assert s["overlap_speedup"] > 0 and s["overlap_speedup_bound"] >= 1.0
    assert s["overlap_speedup_check"] in ("ok", speedup_check(s["overlap_speedup"], s["overlap_speedup_bound"]))
    assert s["workload"]["requests"] == REQUESTS


def test_every_loop_records_warm_and_prefills_cold(traced):
    """Each loop's recording starts after the warm-up and from an empty prefix cache: its first forward is
    the whole workload's prefill, in both loops (the loop recorded first used to carry both alone)."""
    loops = by_pid(load(traced, "trace.json")["traceEvents"])
    for name, evs in loops.items():
        first = min((e for e in evs if e["name"] == "forward"), key=lambda e: e["args"]["step"])
        assert first["args"]["prefill"] and first["args"]["num_tokens"] == REQUESTS * 8, (name, first["args"])


def test_a_speedup_above_its_bound_is_flagged():
    from tandem.trace.summary import summarize
    serial, overlap = fake_recording("serial"), fake_recording("overlap")
    assert summarize([serial, overlap])["overlap_speedup_check"] == "ok"
    slow = dataclasses.replace(serial, summary={**serial.summary, "tokens_per_s": serial.summary["tokens_per_s"] / 3})
    check = summarize([slow, overlap])["overlap_speedup_check"]
    assert check.startswith("the speedup") and "exceeds its bound 1.33" in check


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_timeline_png(traced):
    path = os.path.join(traced, "timeline.png")
    w, h = png_size(path)
    assert w >= 800 and h >= 300 and os.path.getsize(path) > 10_000


def embedded_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="tandem-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_report_html_is_self_contained(traced):
    with open(os.path.join(traced, "report.html"), encoding="utf-8") as f:
        html = f.read()
    for node in NODES:
        assert node in html, node
    data = embedded_data(html)
    assert [d["loop"] for d in data["loops"]] == ["serial", "overlap"]
    for d in data["loops"]:
        assert d["dev"] and d["host"] and len(d["iters"]) == len(d["dev"])
    assert "data:image/png;base64," in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "report must not load from the network"
    assert "<link" not in html


# ---- live --trace -------------------------------------------------------------------------------------------
def test_live_trace_written_on_shutdown(tiny_llama, tmp_path):
    from tandem import LLM, SamplingParams
    out = tmp_path / "live"
    llm = LLM(tiny_llama, scheduler="overlap", kv_cache_tokens=4096, max_running_requests=8,
              trace_dir=str(out), trace_ring_steps=4)
    try:
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    for name in ("trace.json", "timeline.png", "report.html", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["loops"]) == ["overlap"] and summary["loops"]["overlap"]["steps"] == 4   # the ring
    loops = by_pid(json.loads((out / "trace.json").read_text())["traceEvents"])
    assert list(loops) == ["overlap loop"]
    png_size(str(out / "timeline.png"))
    assert "Process results" in (out / "report.html").read_text()


# ---- export on hand-made spans ------------------------------------------------------------------------------
def fake_recording(loop: str, n: int = 5, host: float = 1.0, dev: float = 3.0) -> Recording:
    """Spans (ms) as the loop would record them with the given host work and forward time per step."""
    spans, devs, t, queue = [], [], 0.0, []
    dev_free = 0.0

    def process(k: int, t: float) -> float:
        end_dev = devs[k].end
        spans.append(("wait", k, t + 0.01, max(t + 0.02, end_dev)))
        done = max(t + 0.02, end_dev) + host / 2
        spans.append(("process", k, t, done))
        return done

    for k in range(n + 1):
        spans.append(("recv", -1, t, t + 0.05))
        spans.append(("pick", -1, t + 0.05, t + host / 2))
        t += host / 2
        if k < n:
            spans.append(("launch", k, t, t + 0.1))
            start = max(t + 0.1, dev_free)
            devs.append(DeviceSpan(k, start, start + dev, 2, 2, k == 0, t))
            dev_free = start + dev
            queue.append(k)
            t += 0.1
        if queue and (loop == "serial" or len(queue) > 1 or k == n):
            t = process(queue.pop(0), t)
    s = 1e-3
    host_spans = [(a, b, c * s, d * s) for a, b, c, d in spans]
    dev_spans = [DeviceSpan(d.step, d.start * s, d.end * s, d.batch_size, d.num_tokens, d.is_prefill,
                            d.launch * s) for d in devs]
    summary = {"loop": loop, "device_idle_fraction": 0.0, "steps": n, "wall_s": t * s, "output_tokens": 2 * n,
               "tokens_per_s": 2 * n / (t * s), "host_ms_per_step": host, "device_ms_per_step": dev}
    return Recording(loop, tuple(sorted(host_spans, key=lambda h: (h[2], -h[3]))), tuple(dev_spans), summary)


def test_iterations_attribute_host_work_to_the_launched_step():
    serial, overlap = fake_recording("serial"), fake_recording("overlap")
    assert [k for k, _ in iterations(serial)] == list(range(5))
    assert [k for k, _ in iterations(overlap)] == list(range(5))
    # Overlap: the iteration that launches k processes k-1; the final flush joins the last iteration.
    procs = {k: [h[1] for h in spans if h[0] == "process"] for k, spans in iterations(overlap)}
    assert procs == {0: [], 1: [0], 2: [1], 3: [2], 4: [3, 4]}
    rows = step_rows(serial)
    assert [r.step for r in rows] == list(range(5))
    assert all(r.idle_ms > 0.5 for r in rows[1:])                 # serial: the device waits for the host
    assert all(r.idle_ms < 1e-6 for r in step_rows(overlap)[1:])  # overlap: forward k+1 is queued in time
    assert len(idle_gaps(serial)) == 4 and not idle_gaps(overlap)


def test_report_and_trace_from_hand_made_spans(tmp_path):
    from tandem.trace.export import write_trace_dir
    from tandem.trace.summary import summarize
    recs = [fake_recording("serial"), fake_recording("overlap")]
    paths = write_trace_dir(str(tmp_path), recs, summarize(recs), "fake")
    assert set(os.listdir(tmp_path)) == {"summary.json", "trace.json", "timeline.png", "report.html"}
    data = embedded_data(open(paths["report.html"], encoding="utf-8").read())
    assert data["msPerSecond"] > 0 and len(data["loops"]) == 2
    assert summarize(recs)["overlap_speedup_bound"] == pytest.approx(4.0 / 3.0)


def test_busy_time_is_the_union_of_nested_device_spans():
    # An urgent step's span lies inside the long step it ran in (scheduler/urgent.py), and it starts last.
    from tandem.trace.recorder import Recorder, busy_time
    spans = [DeviceSpan(0, 0.0, 10.0, 1, 256, True, 0.0), DeviceSpan(1, 2.0, 5.0, 1, 64, True, 1.0),
             DeviceSpan(2, 12.0, 15.0, 1, 1, False, 11.0), DeviceSpan(3, 13.0, 14.0, 1, 64, True, 12.5)]
    assert busy_time(spans) == 13.0
    rec = Recorder()
    rec.devices.extend(spans)
    s = rec.summary()
    assert s["wall_s"] == 15.0 and s["device_idle_fraction"] == pytest.approx(2 / 15)
