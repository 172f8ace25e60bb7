"""Run one workload through the serial and the overlap loop on one engine and keep each loop's recording.

One LLM serves both loops (the loop is chosen at run time from the config), so weights, device process and
warm caches are shared. Rounds alternate the loops, because this machine drifts between rounds; the
recording of each loop's last round is the one exported.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from statistics import median

from ..sampling_params import SamplingParams
from .recording import Recording
from .recorder import Recorder

LOOP_NAMES = ("serial", "overlap")


@dataclass(frozen=True)
class Workload:
    requests: int = 16
    max_tokens: int = 16
    input_len: int = 32
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Seeded random prompts of input_len token ids (ids 0..99 are left out: special tokens live there)."""
        rng = random.Random(self.seed)
        lo = min(100, vocab_size // 2)
        return [[rng.randrange(lo, vocab_size) for _ in range(self.input_len)] for _ in range(self.requests)]

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)


def run_once(llm, loop: str, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Run the prompts through `loop` on a cleared recorder and an empty prefix cache (every round prefills
    cold, whichever loop ran before); returns (wall seconds, output tokens)."""
    engine = llm.engine
    engine.scheduler.reset_prefix_cache()
    engine.config = engine.config.replace(scheduler=loop)
    engine.recorder.loop = loop
    engine.recorder.clear()
    before = engine.output_tokens
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, engine.output_tokens - before


WARM_UP_TOKENS = 2       # output tokens of the warm-up runs: the workload's prefill and a decode step at its batch


def warm_up(llm, prompts: list[list[int]], params: SamplingParams, loops: tuple[str, ...] = LOOP_NAMES) -> None:
    """Run the workload's prompts through every loop before any loop records.

    The device process pays for a shape's first run (buffers, pages), and before run_once emptied the prefix
    cache, the loop recorded first also prefilled cold while the next one hit the cache: the serial loop's
    first step read 725 ms against 54 ms (AVX2), and the overlap speedup 1.76x against its own bound of 1.00.
    After this warm-up, every recorded round starts from the same warm device and the same empty cache."""
    warm = SamplingParams(temperature=0.0, max_tokens=min(WARM_UP_TOKENS, params.max_tokens), ignore_eos=True)
    for loop in loops:
        run_once(llm, loop, prompts, warm)
    llm.engine.recorder.clear()


def trace_loops(llm, workload: Workload, rounds: int = 1,
                loops: tuple[str, ...] = LOOP_NAMES) -> tuple[list[Recording], dict[str, list[float]]]:
    """Recordings of each loop's last round, and tokens/s of every round per loop."""
    prompts, params = workload.prompts(llm.engine.model_config.vocab_size), workload.params()
    warm_up(llm, prompts, params, loops)
    ring = llm.engine.recorder.devices.maxlen
    recs: dict[str, Recording] = {}
    tps: dict[str, list[float]] = {loop: [] for loop in loops}
    for r in range(rounds):
        for loop in (loops if r % 2 == 0 else loops[::-1]):
            wall, out = run_once(llm, loop, prompts, params)
            recs[loop] = Recording.take(llm.engine.recorder, wall, out)
            tps[loop].append(out / wall if wall > 0 else 0.0)
            if ring is not None and recs[loop].summary["steps"] >= ring:
                raise ValueError(f"the run took more steps than the recorder ring keeps ({ring}): "
                                 f"raise --trace-ring-steps")
    return [recs[loop] for loop in loops], tps


def recording_overhead(llm, workload: Workload, rounds: int = 3, loop: str = "overlap") -> dict:
    """tokens/s with the recorder on and off (Recorder(enabled=False)), interleaved rounds, medians.

    Also the scheduler process's CPU time per output token (process_time: the host's own work, which is what
    recording adds to), a steadier figure than tokens/s on a shared machine.
    """
    prompts, params = workload.prompts(llm.engine.model_config.vocab_size), workload.params()
    engine = llm.engine
    on, off = engine.recorder, Recorder(enabled=False, loop=loop)
    tps: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                engine.recorder = engine.scheduler.recorder = on if mode == "on" else off
                c = time.process_time()
                wall, out = run_once(llm, loop, prompts, params)
                cpu[mode].append(1e6 * (time.process_time() - c) / max(out, 1))
                tps[mode].append(out / wall if wall > 0 else 0.0)
    finally:
        engine.recorder = engine.scheduler.recorder = on
        on.clear()
    med = {mode: median(v) for mode, v in tps.items()}
    cpu_med = {mode: median(v) for mode, v in cpu.items()}
    return {"loop": loop, "rounds": rounds, "tokens_per_s_on": tps["on"], "tokens_per_s_off": tps["off"],
            "median_on": med["on"], "median_off": med["off"],
            "overhead_fraction": 1.0 - med["on"] / med["off"] if med["off"] > 0 else 0.0,
            "host_cpu_us_per_token_on": cpu_med["on"], "host_cpu_us_per_token_off": cpu_med["off"]}
