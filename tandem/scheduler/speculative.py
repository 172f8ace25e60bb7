"""The speculative-decoding branch of the scheduler: which decode rows draft (pick batch), and when a pick may
assume an in-flight run; how a verified run becomes host truth is Speculation's (tandem/speculative/speculation.py),
called from process results.

A speculating request's k drafts ride as k extra decode rows right after its own (StepInput.draft_lens); the
device samples every row as the plain path samples that output position, and verify.py's rule keeps s_0..s_a.

The one-step lag (overlap loop): step k+1 is picked before step k is processed. A request r whose step k
verifies drafts d_1..d_k is picked in k+1 on an assumption: its run in k is accepted whole and its bonus token
is the n-gram's continuation c (the token that followed the matched text after d_k), s_0..s_k = d_1..d_k, c.
Req.spec.guess holds the assumed tokens (-1 where none is assumed: a plain row's token, or a bonus when the
match ends at d_k). So k+1 gives r the positions, seed positions and KV slots of the assumed lengths; its head
row reads the FutureMap (s_a: c when the assumption holds); its drafts are proposed from fill_ids() + spec.guess
where no entry is -1 (else host truth is fetched first: propose). Processing step k tells whether it held
(Speculation.follow): if so r's rows in k+1 stand as they are; if not they are dropped (Batch.dropped: never
appended, like a finished request riding in a step), r is back at host truth and picked from it again at once, its
next head row taking its last token from the host (the FutureMap row holds the dropped row's token: spec.stale).

KV invariant (enforced in Speculation.follow, tandem/speculative/speculation.py): the slots of rejected drafts and of
dropped rows are freed only when no in-flight step can still touch them: after the last in-flight step of r was
waited for (Batch.release, freed in process_results), or at once when the step just processed was r's last one
launched.

Picked only from host truth (pick_batch processes the pending step first, so such a step runs serially): a
request with an in-flight drafting step that is penalized (the device's penalty counts of a dropped row cannot be
undone), speculates with a draft model (its cache follows host truth), whose runs seldom hold (a failed pick
ahead costs more than the wait: AHEAD_MIN_HOLD), or is served by a hybrid model (a dropped row's tokens would stay
in its linear-attention state: model/verify_runs.py). Grammar rows never draft.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import Req
from ..speculative.ngram import NgramIndex
from ..speculative.speculation import MAX_PROBE_GAP, MAX_VERIFY_ROWS, left
from .results import process_pending

if TYPE_CHECKING:
    from .scheduler import Scheduler

# Picking a request ahead pays only if its in-flight run is likely to hold: a held pick saves the device the host's
# processing of the step (h), a failed one wastes the request's rows of the next step (for one request, the step:
# T). So a request is picked ahead while its estimated hold rate (an EMA over its drafting runs, from 1) is at
# least 1 - h / T; h / T measured: the serial loop's device idle with speculation, SmolLM2-135M Q4_1, 2 shared
# cores, 4-7 % (benchmarks/results/speculative_overlap.md). Erring on the side of waiting: with more requests a failed
# pick wastes only the request's rows, a wait the whole batch's h.
AHEAD_MIN_HOLD = 0.94


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


def may_draft(req: Req) -> bool:
    """Grammar rows never draft: their masks depend on every token before (a mask per draft position is not
    built). Penalized rows do: a draft row counts the drafts before its position (device/penalties.py)."""
    return req.grammar is None and req.params.structured_outputs is None


def assumable(s: "Scheduler", req: Req) -> bool:
    """May be picked while its drafting step is in flight, on the assumption of the docstring above (and while
    that assumption pays: AHEAD_MIN_HOLD). Never on a hybrid model (s.memory.recurrent: its rows hold a
    linear-attention state): a dropped row would still advance the request's state, which, unlike KV slots,
    cannot be freed; model/verify_runs.py relies on this."""
    p, cfg = req.params, s.config.speculative_config
    return cfg is not None and cfg.method == "ngram" and not s.memory.recurrent and \
        req.spec.hold >= AHEAD_MIN_HOLD and not (
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1)


def must_sync(s: "Scheduler") -> bool:
    """An in-flight step drafts for a request that may not be picked on an assumption (pick_batch then
    processes the pending steps first)."""
    return any(k > 0 and r not in b.dropped and not r.finished and not assumable(s, r)
               for b, _ in s.result_queue if b.speculative for r, k in zip(b.reqs, b.step.draft_lens))


def propose(s: "Scheduler", reqs: list[Req]) -> tuple[list[Req], dict[Req, list[int]], dict[Req, int]]:
    """The decode candidates (re-read if host truth had to be brought up to date), their drafts, and the
    n-gram's continuation after each request's last draft (the bonus token a later pick assumes)."""
    cfg, spec = s.config.speculative_config, s.spec
    if cfg is None or len(reqs) > cfg.disable_by_batch_size or spec.max_draft_rows == 0:
        return reqs, {}, {}
    want = {r: k for r in reqs if may_draft(r) and (k := spec.draft_len(cfg, r, len(reqs))) > 0}
    if not want:
        return reqs, {}, {}          # nobody drafts: the overlap loop keeps its one-step lag
    blind = {r for r in want if r.spec.guess and (-1 in r.spec.guess or cfg.method != "ngram")}
    if blind:
        # A drafting request whose in-flight tokens are not assumed (a plain row's, a bonus the n-gram had no
        # continuation for; the draft model follows host truth): its drafts are proposed from host truth.
        spec.stats.syncs += bool(s.result_queue)
        process_pending(s)
        reqs = s.decode_candidates()
    drafts: dict[Req, list[int]] = {}
    bonus: dict[Req, int] = {}
    room = min(spec.max_draft_rows, s.available() - len(reqs), spec.max_verify_rows - len(reqs))   # slots and rows
    with s.recorder.span("propose"):
        if cfg.method == "draft_model" and spec.drafter is not None:
            asked = {}
            for req in reqs:
                k = min(want.get(req, 0), room, left(req))
                if k >= 1:
                    asked[req] = k
                    room -= k
            return reqs, spec.drafter.propose(asked), {}
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
                if req.spec.guess:
                    spec.stats.ahead_drafts += 1      # drafted while its previous step is in flight
            else:
                if req.spec.probing:  # a probe that found nothing to propose failed too
                    req.spec.probing = False
                    req.spec.probe_gap = min(2 * req.spec.probe_gap, MAX_PROBE_GAP)
    return reqs, drafts, bonus


def ngram_drafts(req: Req, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k n-gram tokens to follow req's text: host truth (prompt + outputs) and the tokens the overlap loop
    assumes in flight (spec.guess), from the request's own NgramIndex (built at its first proposal)."""
    if req.spec.ngram is None:
        req.spec.ngram = NgramIndex(lookup_min, lookup_max)
    return req.spec.ngram.propose((req.prompt_ids, req.output_ids), req.spec.guess, k)
