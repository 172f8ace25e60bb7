"""report.html: one self-contained page (no network) with the timelines, a per-step table, the summary and a
replay of the loop diagram of the reference picture, driven by the recorded spans at measured durations.

The page is report_template.html with five markers replaced; the recording travels as inline JSON
(milliseconds from each loop's first span) and the timeline PNG as base64.
"""
from __future__ import annotations

import base64
import html
import json
import os
from importlib import resources
from statistics import median

from .recording import Recording, StepRow, step_rows

PLAYBACK_S_PER_STEP = 2.5      # one median serial step plays in about this many seconds at 1x

SUMMARY_ROWS = (("tokens_per_s", "output tokens/s", "{:.1f}"),
                ("device_idle_fraction", "device idle fraction", "{:.3f}"),
                ("steps", "steps", "{}"),
                ("wall_s", "wall time (s)", "{:.3f}"),
                ("output_tokens", "output tokens", "{}"),
                ("host_ms_per_step", "host ms per step", "{:.3f}"),
                ("device_ms_per_step", "device ms per step", "{:.3f}"),
                ("tokens_per_s_median", "output tokens/s, median of rounds", "{:.1f}"))


def _r(x: float) -> float:
    return round(x, 4)


def loop_data(rec: Recording, rows: list[StepRow]) -> dict:
    """What the replay needs, in ms from the loop's first span."""
    t0 = rec.t0
    ms = lambda t: _r(1e3 * (t - t0))  # noqa: E731
    return {
        "loop": rec.loop,
        "summary": rec.summary,
        "host": [[n, k, ms(s), ms(e)] for n, k, s, e in rec.host],
        "dev": [[d.step, ms(d.launch), ms(d.start), ms(d.end), d.batch_size, d.num_tokens, int(d.is_prefill)]
                for d in rec.devices],
        "iters": [[r.step, _r(r.start_ms), int(r.is_prefill)] for r in rows],
    }


def playback_ms_per_s(recs: list[Recording], rows: list[list[StepRow]]) -> float:
    """Measured ms shown per second of playback: a median step of the first loop lasts PLAYBACK_S_PER_STEP."""
    starts = [r.start_ms for r in rows[0] if not r.is_prefill] if rows else []
    periods = [b - a for a, b in zip(starts, starts[1:])]
    step_ms = median(periods) if periods else max((r.device_ms for rs in rows for r in rs), default=1.0)
    return max(step_ms, 1e-3) / PLAYBACK_S_PER_STEP


def summary_table(summary: dict) -> str:
    loops = list(summary["loops"])
    head = "".join(f"<th>{html.escape(lp)}</th>" for lp in loops)
    body = []
    for key, label, fmt in SUMMARY_ROWS:
        if any(key in summary["loops"][lp] for lp in loops):
            cells = "".join(f"<td>{fmt.format(summary['loops'][lp][key])}</td>" if key in summary["loops"][lp]
                            else "<td></td>" for lp in loops)
            body.append(f"<tr><th>{label}</th>{cells}</tr>")
    rows = "".join(body)
    extra = ""
    if "overlap_speedup" in summary:
        extra = (f"<p class=big>overlap / serial tokens/s: <b>{summary['overlap_speedup']:.2f}</b> "
                 f"&nbsp; bound (host + device) / max(host, device) from the serial run: "
                 f"<b>{summary['overlap_speedup_bound']:.2f}</b></p>")
        if summary.get("overlap_speedup_check", "ok") != "ok":
            extra += f"<p class=warn>{html.escape(summary['overlap_speedup_check'])}</p>"
    if "recording_overhead" in summary:
        o = summary["recording_overhead"]
        extra += (f"<p>recording overhead ({o['loop']} loop, {o['rounds']} rounds): "
                  f"<b>{100 * o['overhead_fraction']:+.1f} %</b> tokens/s "
                  f"({o['median_on']:.1f} on vs {o['median_off']:.1f} off); scheduler CPU per output token "
                  f"{o['host_cpu_us_per_token_on']:.1f} &micro;s on vs "
                  f"{o['host_cpu_us_per_token_off']:.1f} &micro;s off</p>")
    return f"<table class=summary><tr><th></th>{head}</tr>{rows}</table>{extra}{stage_table(summary)}"


def stage_table(summary: dict) -> str:
    """Pipeline stages (PP loop): each stage's busy and send ms per step and its bubble fraction."""
    out = []
    for loop, sm in summary["loops"].items():
        if sm.get("pp_stages"):
            rows = "".join(f"<tr><td>{st['stage']}</td><td>{st['steps']}</td><td>{st['busy_ms_per_step']:.3f}</td>"
                           f"<td>{st['comm_ms_per_step']:.3f}</td><td>{st['bubble_fraction']:.3f}</td></tr>"
                           for st in sm["pp_stages"])
            out.append(f"<h3>{html.escape(loop)} loop: pipeline stages</h3><table class=summary><tr><th>stage</th>"
                       "<th>micro-batches</th><th>busy ms per step</th><th>send ms per step</th>"
                       f"<th>bubble fraction</th></tr>{rows}</table>")
    return "".join(out)


def step_table(rec: Recording, rows: list[StepRow]) -> str:
    lines = [f"<tr><td>{r.step}</td><td>{'prefill' if r.is_prefill else 'verify' if r.draft_tokens else 'decode'}</td><td>{r.batch_size}</td>"
             f"<td>{r.num_tokens}</td><td>{r.host_ms:.3f}</td><td>{r.wait_ms:.3f}</td><td>{r.device_ms:.3f}</td>"
             f"<td>{r.idle_ms:.3f}</td></tr>" for r in rows]
    return (f"<div class=steps><h3>{html.escape(rec.loop)} loop: {len(rows)} steps</h3><div class=scroll>"
            "<table><tr><th>step</th><th>kind</th><th>batch size</th><th>tokens</th><th>host ms</th>"
            "<th>wait ms</th><th>device ms</th><th>idle ms</th></tr>" + "".join(lines) + "</table></div></div>")


def render_report(recs: list[Recording], summary: dict, png_path: str | None, title: str) -> str:
    rows = [step_rows(r) for r in recs]
    data = {"loops": [loop_data(r, rs) for r, rs in zip(recs, rows)],
            "msPerSecond": playback_ms_per_s(recs, rows), "title": title}
    png = ""
    if png_path and os.path.exists(png_path):
        with open(png_path, "rb") as f:
            png = ("<img class=timeline alt='serial and overlap timelines' src='data:image/png;base64,"
                   + base64.b64encode(f.read()).decode() + "'>")
    page = resources.files(__package__).joinpath("report_template.html").read_text(encoding="utf-8")
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    for marker, value in (("__TITLE__", html.escape(title)), ("__SUMMARY__", summary_table(summary)),
                          ("__TIMELINE__", png), ("__STEPS__", "".join(step_table(r, rs) for r, rs in zip(recs, rows))),
                          ("__DATA__", blob)):
        page = page.replace(marker, value)
    return page


def write_report(path: str, recs: list[Recording], summary: dict, png_path: str | None, title: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_report(recs, summary, png_path, title))
