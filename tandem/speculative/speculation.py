"""The speculative branch's engine-wide state and the rules over it alone: Speculation, which the Scheduler is
given: its limits, the drafter, what a row and a draft cost (measured as the engine runs), its counts (SpecStats),
and how a verified run is settled against what later in-flight steps assumed (follow). A request's own state is
Req.spec (SpecState, tandem/request.py).

Which rows draft, and picking on the overlap loop's assumption, is the scheduler's side of the branch
(tandem/scheduler/speculative.py, whose docstring states the assumption and the KV invariant that follow
enforces). This module imports nothing of the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable


if TYPE_CHECKING:
    from ..request import Req
    from .config import SpeculativeConfig

PROBE_EVERY = 16          # a request whose drafts do not pay drafts one token again after this many steps,
EMA_WEIGHT = 0.3          # weight of the newest verified run in a request's acceptance estimate
MAX_PROBE_GAP = 256       # doubling after each probe that accepted nothing (a probe in the overlap loop costs a sync)
# Cost of one more row in a decode step, as a fraction of a one-row step, until the engine has measured it
# (observe_step): measured on SmolLM2-135M Q4_1, 2 cores, serial loop, verify steps of one request whose drafts are
# all rejected, with the row layout's GEMV: 4 drafts cost 1.82x a plain step, 8 drafts 2.52x (0.20 and 0.19 a
# row). The repacked GEMV (the gemv_packed_q8act op) made a row cheaper, and rows cost differently on every CPU and
# model: hence the measured value (Speculation.row_cost).
ROW_COST = 0.2
ROW_COST_RANGE = (0.02, 1.0)     # a measured sample is clipped to this (a shared machine's outliers)
# Rows a verify step carries at most (Speculation.max_verify_rows, from the engine: scheduler/speculative.py's
# verify_rows): up to here the native decode path keeps its few-row kernels, as a plain decode step does: the
# quantized linears' GEMV bodies up to kernels.quant.small_m() rows (96 on AVX-512 CPUs, 16 on AVX2-only ones; the
# engine caps this by it), and SiLU x up the native op up to the same.
MAX_VERIFY_ROWS = 64



@dataclass
class SpecStats:
    """Engine-wide counts of the speculative branch (Scheduler.stats reports them)."""
    draft_tokens: int = 0                  # drafts verified
    accepted_tokens: int = 0               # of those, accepted
    accepted_hist: dict[int, int] = field(default_factory=dict)    # verified runs by their accepted drafts
    ahead_drafts: int = 0                  # drafting picks made while the request's previous step was in flight
    ahead_dropped: int = 0                 # picks ahead whose assumption failed (their rows dropped)
    syncs: int = 0                         # picks that first waited for host truth (not assumable)

    def as_stats(self) -> dict:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_ahead_drafts": self.ahead_drafts,
            "spec_ahead_dropped": self.ahead_dropped,
            "spec_syncs": self.syncs,
            # verified runs that accepted a drafts, one flat key per a (replicas' stats are summed key by key)
            **{f"spec_accepted_len_{a}": n for a, n in sorted(self.accepted_hist.items())},
        }

def acceptance(req: "Req") -> float:
    """Estimated chance that a draft is accepted given the ones before it were: accepted drafts over draft
    trials (accepted + the first rejected one), both as EMAs over the request's verified runs."""
    return req.spec.acc / req.spec.trials


def left(req: "Req") -> int:
    """Drafts a step may still carry for req: its rows sample output positions up to max_tokens - 1 (the
    positions of its in-flight tokens, assumed or not, come first)."""
    return req.max_new_tokens() - len(req.output_ids) - len(req.spec.guess) - 1


@dataclass
class Speculation:
    """The speculative branch's engine-wide state, given to the Scheduler at construction."""
    max_draft_rows: int = 0               # draft rows the device buffers hold (RunnerSpec.max_draft_rows)
    max_verify_rows: int = MAX_VERIFY_ROWS    # rows a verify step may carry
    drafter: object | None = None         # the draft model (speculative_config method "draft_model")
    stats: SpecStats = field(default_factory=SpecStats)
    row_cost: float = ROW_COST            # one more decode row's cost over a one-row step (observe_step)
    plain_step_s: dict[int, float] = field(default_factory=dict)   # EMA of a draft-free decode step by its rows
    decode_step_s: float | None = None    # EMA of a decode step's device time, while a drafter runs

    def draft_len(self, cfg: "SpeculativeConfig", req: "Req", batch: int) -> int:
        """Adaptive k: draft the j-th token only while p^j, the chance it is reached and accepted, exceeds what
        its row costs in tokens of the plain step, c B / (1 + c (B - 1)) at B decode requests, c = row_cost (one
        row's time at the plain step's rate). So k shrinks as acceptance falls or the batch grows, and is 0 once
        drafts do not pay (then a probe draft after PROBE_EVERY steps, the gap doubling while probes fail,
        re-measures it). With a draft model each draft also costs a draft step (draft_cost). Never past
        max_tokens."""
        limit = left(req)
        c = self.row_cost
        p, cost = acceptance(req), c * batch / (1 + c * (batch - 1)) + self.draft_cost()
        k = 0
        while k < cfg.num_speculative_tokens and p ** (k + 1) > cost:
            k += 1
        st = req.spec
        if k == 0:
            st.skipped += 1
            if st.skipped >= st.probe_gap:
                k, st.skipped, st.probing = 1, 0, True
        else:
            st.skipped = 0
        return max(0, min(k, limit))

    def draft_cost(self) -> float:
        """What drafting one more token with the draft model costs, in tokens of the plain step: one draft step
        (shared by the batch's drafting requests, as a target step is shared by its rows) over one target decode
        step, both measured (EMAs of the draft steps' wall time and of the target decode steps' device time); 0
        for n-gram."""
        d = self.drafter
        if d is None or d.step_s is None or not self.decode_step_s:
            return 0.0
        return d.step_s / self.decode_step_s

    def observe_step(self, draft_lens, seconds: float) -> None:
        """Measure what one more row costs (row_cost) from the device time of decode steps. Model: a step of R
        rows takes t1 (1 + c (R - 1)). Steps without drafts give t(B) per batch size B (EMAs); a verify step of B
        requests and R rows then gives r = t(R) / t(B) - 1 = c (R - B) / (1 + c (B - 1)), so
        c = r / (R - B - r (B - 1)), clipped to ROW_COST_RANGE and averaged (EMA) into row_cost."""
        rows = len(draft_lens)
        b = rows - int((draft_lens < 0).sum())
        if rows == b:
            if b <= self.max_verify_rows:
                t = self.plain_step_s.get(b)
                self.plain_step_s[b] = seconds if t is None else (1 - EMA_WEIGHT) * t + EMA_WEIGHT * seconds
            return
        t = self.plain_step_s.get(b)
        if not t:
            return
        r = seconds / t - 1
        den = rows - b - r * (b - 1)
        c = ROW_COST_RANGE[1] if den <= 0 else min(max(r / den, ROW_COST_RANGE[0]), ROW_COST_RANGE[1])
        self.row_cost = (1 - EMA_WEIGHT) * self.row_cost + EMA_WEIGHT * c

    def observe_decode(self, seconds: float) -> None:
        """A target decode step's device time, what a draft model step is priced against (draft_cost)."""
        if self.drafter is not None:
            self.decode_step_s = seconds if self.decode_step_s is None else \
                0.8 * self.decode_step_s + 0.2 * seconds

    def settle(self, req: "Req", k: int, accepted: int) -> None:
        """Count a verified run of `k` drafts, `accepted` of them kept (its KV slots: follow)."""
        st = self.stats
        st.draft_tokens += k
        st.accepted_tokens += accepted
        st.accepted_hist[accepted] = st.accepted_hist.get(accepted, 0) + 1
        spec = req.spec
        spec.acc = (1 - EMA_WEIGHT) * spec.acc + EMA_WEIGHT * accepted
        spec.trials = (1 - EMA_WEIGHT) * spec.trials + EMA_WEIGHT * (accepted + (accepted < k))
        if spec.probing:             # a probe: back off while they fail, back to the first gap once one pays
            spec.probing = False
            spec.probe_gap = PROBE_EVERY if accepted else min(2 * spec.probe_gap, MAX_PROBE_GAP)

    def follow(self, req: "Req", k: int, run: list[int], in_flight: list, free: Callable[[list[int]], None]) -> None:
        """A processed row's run s_0..s_a (k drafts; a plain row: k = 0, one token) against what the later
        in-flight steps of req assumed (spec.guess). Held: they stand. Failed: their rows of req are dropped, and
        req is back at host truth. The KV slots past the run (rejected drafts, dropped rows) go, by the KV
        invariant of scheduler/speculative.py: freed only once no in-flight step can still touch them.
        in_flight: the batches still queued after this one (the result queue); free: frees KV slots now."""
        a = len(run) - 1
        spec = req.spec
        guess, spec.guess = spec.guess[:k + 1], spec.guess[k + 1:]
        held = a == k and all(g < 0 or g == t for g, t in zip(guess, run))
        if k and len(guess) > k and guess[k] >= 0:    # a run a drafting pick could have been made ahead of
            spec.hold = (1 - EMA_WEIGHT) * spec.hold + EMA_WEIGHT * held
        n = k - a                                # slots past the run: the rejected drafts', then any dropped row's
        if spec.guess and not held:
            later = [b for b in in_flight if req in b.reqs and req not in b.dropped]
            for b in later:
                b.dropped.add(req)
            n += len(spec.guess)                 # one slot per in-flight token
            if later:
                later[-1].release.extend(req.slots[-n:])   # freed once the last step that may touch them is waited for
            else:
                free(req.slots[-n:])
            spec.guess, spec.stale = [], True
            self.stats.ahead_dropped += 1
        elif n:
            free(req.slots[-n:])                 # no later step of req in flight: their writer was waited for
        if n:
            del req.slots[-n:]
            req.num_launched -= n
        req.filled = req.kv_committed = req.allocated
