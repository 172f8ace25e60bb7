"""summary.json: the per-loop Recorder summaries and the overlap speedup with its bound."""
from __future__ import annotations

from statistics import median

from .recording import Recording


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
