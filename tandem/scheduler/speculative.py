"""The speculative-decoding branch of the scheduler: which decode rows draft (pick batch), and how a verified
run becomes host truth (process results).

A speculating request's k drafts ride as k extra decode rows right after its own (StepInput.draft_lens); the
device samples every row as the plain path samples that output position, and verify.py's rule keeps s_0..s_a.

The one-step lag (overlap loop): step k+1 is picked before step k is processed. A request r whose step k
verifies drafts d_1..d_k is picked in k+1 on an assumption: its run in k is accepted whole and its bonus token
is the n-gram's continuation c (the token that followed the matched text after d_k), s_0..s_k = d_1..d_k, c.
Req.spec_guess holds the assumed tokens (-1 where none is assumed: a plain row's token, or a bonus when the
match ends at d_k). So k+1 gives r the positions, seed positions and KV slots of the assumed lengths; its head
row reads the FutureMap (s_a: c when the assumption holds); its drafts are proposed from fill_ids() + spec_guess
where no entry is -1 (else host truth is fetched first: propose). Processing step k tells whether it held
(follow): if so r's rows in k+1 stand as they are; if not they are dropped (Batch.dropped: never appended, like
a finished request riding in a step), r is back at host truth and picked from it again at once, its next head
row taking its last token from the host (the FutureMap row holds the dropped row's token: Req.spec_stale).

KV invariant (enforced in follow): the slots of rejected drafts and of dropped rows are freed only when no
in-flight step can still touch them: after the last in-flight step of r was waited for (Batch.release, freed in
process_results), or at once when the step just processed was r's last one launched.

Picked only from host truth (pick_batch processes the pending step first, so such a step runs serially): a
request with an in-flight drafting step that is penalized (the device's penalty counts of a dropped row cannot be
undone), speculates with a draft model (its cache follows host truth), or whose runs seldom hold (a failed pick
ahead costs more than the wait: AHEAD_MIN_HOLD). Grammar rows never draft.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import Req
from ..speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from .scheduler import Scheduler

EMA_WEIGHT = 0.3          # weight of the newest verified run in a request's acceptance estimate
PROBE_EVERY = 16          # a request whose drafts do not pay drafts one token again after this many steps,
MAX_PROBE_GAP = 256       # doubling after each probe that accepted nothing (a probe in the overlap loop costs a sync)
# Cost of one more row in a decode step, as a fraction of a one-row step, until the engine has measured it
# (observe_step): measured on SmolLM2-135M Q4_1, 2 cores, serial loop, verify steps of one request whose drafts are
# all rejected, with the row layout's GEMV: 4 drafts cost 1.82x a plain step, 8 drafts 2.52x (0.20 and 0.19 a
# row). The repacked GEMV (kernels/csrc/qgemv_packed.cpp) made a row cheaper, and rows cost differently on
# every CPU and model: hence the measured value (Scheduler.row_cost).
ROW_COST = 0.2
ROW_COST_RANGE = (0.02, 1.0)     # a measured sample is clipped to this (a shared machine's outliers)
# Rows a verify step carries at most (Scheduler.max_verify_rows, set by the engine): up to here the native decode
# path keeps its few-row kernels, as a plain decode step does: the quantized linears' GEMV bodies up to
# kernels.quant.small_m() rows (96 on AVX-512 CPUs, 16 on AVX2-only ones; the engine caps this by it), and SiLU
# x up the native op up to the same.
MAX_VERIFY_ROWS = 64


def verify_rows(spec) -> int:
    """Rows a verify step of this engine may carry: MAX_VERIFY_ROWS, capped on the native CPU kernels where the
    quantized linears stop treating each row as alone, so a verify step computes every row as the plain step
    does. spec: the engine's RunnerSpec."""
    if spec.max_draft_rows == 0 or spec.kernels != "native" or not str(spec.device).startswith("cpu"):
        return MAX_VERIFY_ROWS
    from .. import kernels
    if not kernels.available():
        return MAX_VERIFY_ROWS
    from ..kernels.quant import small_m
    return min(MAX_VERIFY_ROWS, small_m())
# Picking a request ahead pays only if its in-flight run is likely to hold: a held pick saves the device the host's
# processing of the step (h), a failed one wastes the request's rows of the next step (for one request, the step:
# T). So a request is picked ahead while its estimated hold rate (an EMA over its drafting runs, from 1) is at
# least 1 - h / T; h / T measured: the serial loop's device idle with speculation, SmolLM2-135M Q4_1, 2 shared
# cores, 4-7 % (benchmarks/results/speculative_overlap.md). Erring on the side of waiting: with more requests a failed
# pick wastes only the request's rows, a wait the whole batch's h.
AHEAD_MIN_HOLD = 0.94


def may_draft(req: Req) -> bool:
    """Grammar rows never draft: their masks depend on every token before (a mask per draft position is not
    built). Penalized rows do: a draft row counts the drafts before its position (device/penalties.py)."""
    return req.grammar is None and req.params.structured_outputs is None


def assumable(s: "Scheduler", req: Req) -> bool:
    """May be picked while its drafting step is in flight, on the assumption of the docstring above (and while
    that assumption pays: AHEAD_MIN_HOLD)."""
    p, cfg = req.params, s.config.speculative_config
    return cfg is not None and cfg.method == "ngram" and req.spec_hold >= AHEAD_MIN_HOLD and not (
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1)


def must_sync(s: "Scheduler") -> bool:
    """An in-flight step drafts for a request that may not be picked on an assumption (pick_batch then
    processes the pending steps first)."""
    return any(k > 0 and r not in b.dropped and not r.finished and not assumable(s, r)
               for b, _ in s.result_queue if b.speculative for r, k in zip(b.reqs, b.step.draft_lens))


def left(req: Req) -> int:
    """Drafts a step may still carry for req: its rows sample output positions up to max_tokens - 1 (the
    positions of its in-flight tokens, assumed or not, come first)."""
    return req.max_new_tokens() - len(req.output_ids) - len(req.spec_guess) - 1


def acceptance(req: Req) -> float:
    """Estimated chance that a draft is accepted given the ones before it were: accepted drafts over draft
    trials (accepted + the first rejected one), both as EMAs over the request's verified runs."""
    return req.spec_acc / req.spec_trials


def draft_len(s: "Scheduler", req: Req, batch: int) -> int:
    """Adaptive k: draft the j-th token only while p^j, the chance it is reached and accepted, exceeds what its
    row costs in tokens of the plain step, c B / (1 + c (B - 1)) at B decode requests, c = s.row_cost (one row's
    time at the plain step's rate). So k shrinks as acceptance falls or the batch grows, and is 0 once drafts do
    not pay (then a probe draft after PROBE_EVERY steps, the gap doubling while probes fail, re-measures it).
    With a draft model each draft also costs a draft step (draft_cost). Never past max_tokens."""
    cfg = s.config.speculative_config
    limit = left(req)
    c = s.row_cost
    p, cost = acceptance(req), c * batch / (1 + c * (batch - 1)) + draft_cost(s)
    k = 0
    while k < cfg.num_speculative_tokens and p ** (k + 1) > cost:
        k += 1
    if k == 0:
        req.spec_skipped += 1
        if req.spec_skipped >= req.spec_probe_gap:
            k, req.spec_skipped, req.spec_probing = 1, 0, True
    else:
        req.spec_skipped = 0
    return max(0, min(k, limit))


def observe_step(s: "Scheduler", draft_lens, seconds: float) -> None:
    """Measure what one more row costs (Scheduler.row_cost) from the device time of decode steps. Model: a step of
    R rows takes t1 (1 + c (R - 1)). Steps without drafts give t(B) per batch size B (EMAs); a verify step of B
    requests and R rows then gives r = t(R) / t(B) - 1 = c (R - B) / (1 + c (B - 1)), so c = r / (R - B - r (B - 1)),
    clipped to ROW_COST_RANGE and averaged (EMA) into s.row_cost."""
    rows = len(draft_lens)
    b = rows - int((draft_lens < 0).sum())
    if rows == b:
        if b <= s.max_verify_rows:
            t = s.plain_step_s.get(b)
            s.plain_step_s[b] = seconds if t is None else (1 - EMA_WEIGHT) * t + EMA_WEIGHT * seconds
        return
    t = s.plain_step_s.get(b)
    if not t:
        return
    r = seconds / t - 1
    den = rows - b - r * (b - 1)
    c = ROW_COST_RANGE[1] if den <= 0 else min(max(r / den, ROW_COST_RANGE[0]), ROW_COST_RANGE[1])
    s.row_cost = (1 - EMA_WEIGHT) * s.row_cost + EMA_WEIGHT * c


def draft_cost(s: "Scheduler") -> float:
    """What drafting one more token with the draft model costs, in tokens of the plain step: one draft step
    (shared by the batch's drafting requests, as a target step is shared by its rows) over one target decode step,
    both measured (EMAs of the draft steps' wall time and of the target decode steps' device time); 0 for n-gram."""
    d = s.drafter
    if d is None or d.step_s is None or not s.decode_step_s:
        return 0.0
    return d.step_s / s.decode_step_s


def propose(s: "Scheduler", reqs: list[Req]) -> tuple[list[Req], dict[Req, list[int]], dict[Req, int]]:
    """The decode candidates (re-read if host truth had to be brought up to date), their drafts, and the
    n-gram's continuation after each request's last draft (the bonus token a later pick assumes)."""
    cfg = s.config.speculative_config
    if cfg is None or len(reqs) > cfg.disable_by_batch_size or s.max_draft_rows == 0:
        return reqs, {}, {}
    want = {r: k for r in reqs if may_draft(r) and (k := draft_len(s, r, len(reqs))) > 0}
    if not want:
        return reqs, {}, {}          # nobody drafts: the overlap loop keeps its one-step lag
    blind = {r for r in want if r.spec_guess and (-1 in r.spec_guess or cfg.method != "ngram")}
    if blind:
        # A drafting request whose in-flight tokens are not assumed (a plain row's, a bonus the n-gram had no
        # continuation for; the draft model follows host truth): its drafts are proposed from host truth.
        s.spec_syncs += bool(s.result_queue)
        s.process_pending()
        from .pick import _decode_candidates
        reqs = _decode_candidates(s)
    drafts: dict[Req, list[int]] = {}
    bonus: dict[Req, int] = {}
    room = min(s.max_draft_rows, s.available() - len(reqs), s.max_verify_rows - len(reqs))   # slots and rows
    with s.recorder.span("propose"):
        if cfg.method == "draft_model" and s.drafter is not None:
            asked = {}
            for req in reqs:
                k = min(want.get(req, 0), room, left(req))
                if k >= 1:
                    asked[req] = k
                    room -= k
            return reqs, s.drafter.propose(asked), {}
        for req in reqs:
            k = min(want.get(req, 0), room, left(req))
            if k < 1:
                continue
            d = ngram_drafts(req, k + 1, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if d:
                drafts[req] = d[:k]
                if len(d) > k:
                    bonus[req] = d[k]
                room -= len(drafts[req])
                if req.spec_guess:
                    s.spec_ahead_drafts += 1          # drafted while its previous step is in flight
            else:
                if req.spec_probing:  # a probe that found nothing to propose failed too
                    req.spec_probing = False
                    req.spec_probe_gap = min(2 * req.spec_probe_gap, MAX_PROBE_GAP)
    return reqs, drafts, bonus


def ngram_drafts(req: Req, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k n-gram tokens to follow req's text: host truth (prompt + outputs) and the tokens the overlap loop
    assumes in flight (spec_guess), from the request's own NgramIndex (built at its first proposal)."""
    if req.ngram is None:
        req.ngram = NgramIndex(lookup_min, lookup_max)
    return req.ngram.propose((req.prompt_ids, req.output_ids), req.spec_guess, k)


def _update(req: Req, accepted: int, trials: int) -> None:
    req.spec_acc = (1 - EMA_WEIGHT) * req.spec_acc + EMA_WEIGHT * accepted
    req.spec_trials = (1 - EMA_WEIGHT) * req.spec_trials + EMA_WEIGHT * trials


def settle(s: "Scheduler", req: Req, k: int, accepted: int) -> None:
    """Count a verified run of `k` drafts, `accepted` of them kept (its KV slots: follow)."""
    s.spec_draft_tokens += k
    s.spec_accepted_tokens += accepted
    s.spec_accepted_hist[accepted] = s.spec_accepted_hist.get(accepted, 0) + 1
    _update(req, accepted, accepted + (accepted < k))
    if req.spec_probing:               # a probe: back off while they fail, back to the first gap once one pays
        req.spec_probing = False
        req.spec_probe_gap = PROBE_EVERY if accepted else min(2 * req.spec_probe_gap, MAX_PROBE_GAP)


def follow(s: "Scheduler", req: Req, k: int, run: list[int]) -> None:
    """A processed row's run s_0..s_a (k drafts; a plain row: k = 0, one token) against what the later in-flight
    steps of req assumed (spec_guess). Held: they stand. Failed: their rows of req are dropped, and req is back
    at host truth. The KV slots past the run (rejected drafts, dropped rows) go: the invariant above."""
    a = len(run) - 1
    guess, req.spec_guess = req.spec_guess[:k + 1], req.spec_guess[k + 1:]
    held = a == k and all(g < 0 or g == t for g, t in zip(guess, run))
    if k and len(guess) > k and guess[k] >= 0:    # a run a drafting pick could have been made ahead of
        req.spec_hold = (1 - EMA_WEIGHT) * req.spec_hold + EMA_WEIGHT * held
    n = k - a                                # slots past the run: the rejected drafts', then any dropped row's
    if req.spec_guess and not held:
        later = [b for b, _ in s.result_queue if req in b.reqs and req not in b.dropped]
        for b in later:
            b.dropped.add(req)
        n += len(req.spec_guess)             # one slot per in-flight token
        if later:
            later[-1].release.extend(req.slots[-n:])     # freed once the last step that may touch them was waited for
        else:
            s.kv.free(req.slots[-n:])
        req.spec_guess, req.spec_stale = [], True
        s.spec_ahead_dropped += 1
    elif n:
        s.kv.free(req.slots[-n:])            # no later step of req in flight: the step that wrote them was waited for
    if n:
        del req.slots[-n:]
        req.num_launched -= n
    req.filled = req.kv_committed = req.allocated
