"""Timeline PNG: the loops one above the other on a shared time axis, host and device lanes, idle shaded.

Each loop is shown over the same steady-state window: it starts at the loop's first decode forward and is as
long as the shorter decode phase (at most MAX_WINDOW_STEPS serial steps), so the panels compare like with like.
"""
from __future__ import annotations

from statistics import median

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .recording import Recording, idle_gaps  # noqa: E402

MAX_WINDOW_STEPS = 12
HOST_COLORS = {"recv": "#94a3b8", "pick": "#64748b", "launch": "#2563eb", "process": "#7c3aed",
               "wait": "#ddd6fe", "mask": "#f59e0b",
               "propose": "#10b981"}
PREFILL, DECODE, IDLE = "#166534", "#22c55e", "#ef4444"
HOST_Y, DEVICE_Y, LANE_H = 1.0, 0.0, 0.8


def _decode_span(rec: Recording) -> tuple[float, float]:
    decodes = [d for d in rec.devices if not d.is_prefill] or list(rec.devices)
    return (decodes[0].start, decodes[-1].end) if decodes else (rec.t0, rec.t0)


def steady_windows(recs: list[Recording]) -> tuple[list[float], float]:
    """(window start of each loop, common window length), in seconds on each loop's own clock."""
    spans = [_decode_span(r) for r in recs]
    length = min((e - s for s, e in spans), default=0.0)
    periods = [b.start - a.start for r in recs[:1] for a, b in zip(r.devices, r.devices[1:]) if not a.is_prefill]
    if periods:
        length = min(length, MAX_WINDOW_STEPS * median(periods))
    if length <= 0:       # no decode phase: show whole runs
        spans = [(r.t0, max([d.end for d in r.devices] + [h[3] for h in r.host], default=r.t0)) for r in recs]
        length = max((e - s for s, e in spans), default=1e-3) or 1e-3
    pad = 0.03 * length
    return [s - pad for s, _ in spans], length + 2 * pad


def _bars(ax, spans: list[tuple[float, float]], y: float, color: str, **kw) -> None:
    if spans:
        ax.broken_barh([(s, e - s) for s, e in spans], (y - LANE_H / 2, LANE_H), facecolors=color, **kw)


def _panel(ax, rec: Recording, start: float, length: float) -> None:
    ms = lambda t: 1e3 * (t - start)  # noqa: E731
    end = start + length
    for name in ("process", "wait", "mask", "recv", "pick", "propose", "launch"):   # short spans last, on top
        spans = [(ms(s), ms(e)) for n, _, s, e in rec.host if n == name and e >= start and s <= end]
        # An edge in the span's own colour keeps sub-pixel host spans visible (about 1 px) next to long forwards.
        color = HOST_COLORS[name]
        _bars(ax, spans, HOST_Y, color, edgecolor=color, linewidth=0 if name == "wait" else 0.8)
    gaps = [(ms(s), ms(e)) for s, e in idle_gaps(rec) if e >= start and s <= end]
    _bars(ax, gaps, DEVICE_Y, IDLE, alpha=0.3, linewidth=0)
    for d in rec.devices:
        if d.end < start or d.start > end:
            continue
        s, e = ms(d.start), ms(d.end)
        _bars(ax, [(s, e)], DEVICE_Y, PREFILL if d.is_prefill else DECODE, edgecolor="white", linewidth=0.5)
        if e - s > 0.04 * 1e3 * length:
            ax.text((s + e) / 2, DEVICE_Y, f"{d.step}", ha="center", va="center", fontsize=7, color="white",
                    clip_on=True)
    stages = sorted({k for d in rec.devices for k, *_ in d.stages})
    for d in rec.devices:                  # the pipeline: a lane per stage under the device lane
        for k, s, e, _ in d.stages:
            if e >= start and s <= end:
                _bars(ax, [(ms(s), ms(e))], DEVICE_Y - 1 - stages.index(k), PREFILL if d.is_prefill else DECODE,
                      edgecolor="white", linewidth=0.5)
    for n, k, s, e in rec.host:
        if n == "process" and start <= s <= end and ms(e) - ms(s) > 0.04 * 1e3 * length:
            ax.text((ms(s) + ms(e)) / 2, HOST_Y + 0.52, f"{k}", ha="center", va="bottom", fontsize=6,
                    color="#7c3aed", clip_on=True)
    sm = rec.summary
    ax.set_title(f"{rec.loop} loop: device idle {100 * sm['device_idle_fraction']:.1f} %, "
                 f"{sm['tokens_per_s']:.0f} tok/s  (host {sm['host_ms_per_step']:.2f} ms, "
                 f"device {sm['device_ms_per_step']:.2f} ms per step)", fontsize=9, loc="left")
    ax.set_yticks([DEVICE_Y - 1 - i for i in range(len(stages))] + [DEVICE_Y, HOST_Y],
                  [f"stage {k}" for k in stages] + ["device" if not stages else "last stage", "host"])
    ax.set_ylim(-0.6 - len(stages), 1.75)
    ax.set_xlim(0, 1e3 * length)
    ax.grid(axis="x", color="#e5e7eb", linewidth=0.5)
    ax.set_axisbelow(True)


def plot_timelines(recs: list[Recording], path: str) -> None:
    starts, length = steady_windows(recs)
    lanes = max((len({k for d in r.devices for k, *_ in d.stages}) for r in recs), default=0)
    fig, axes = plt.subplots(len(recs), 1, figsize=(12, 1.1 + (1.6 + 0.5 * lanes) * len(recs)), sharex=True,
                             squeeze=False)
    for ax, rec, start in zip(axes[:, 0], recs, starts):
        _panel(ax, rec, start, length)
    axes[-1, 0].set_xlabel("ms from the first decode forward (same window length in every panel; "
                           "numbers are step ids: device forward k, host process results k)", fontsize=8)
    legend = [Patch(color=HOST_COLORS["recv"], label="recv"), Patch(color=HOST_COLORS["pick"], label="pick batch"),
              Patch(color=HOST_COLORS["launch"], label="launch step"),
              Patch(color=HOST_COLORS["process"], label="process results"),
              Patch(color=HOST_COLORS["wait"], label="wait copy_done"), Patch(color=PREFILL, label="prefill"),
              Patch(color=DECODE, label="decode forward"), Patch(color=IDLE, alpha=0.3, label="device idle")]
    fig.legend(handles=legend, loc="lower center", ncol=8, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(recs) > 1 else 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
