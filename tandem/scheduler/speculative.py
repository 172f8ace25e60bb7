"""The speculative-decoding branch of the scheduler: which decode rows draft (pick batch), and how a verified
run becomes host truth (process results).

A speculating request's k drafts ride as k extra decode rows right after its own (StepInput.draft_lens); the
device samples every row as the plain path samples that output position, and verify.py's rule keeps s_0..s_a.

Loop invariant (enforced in pick_batch and propose): a step that carries drafts is picked and launched only when
no step is in flight (host truth is current), and no step is picked after it until it has been processed. So
under the overlap loop a speculative step runs like a serial one: the host knows every request's accepted
count before it computes the next step's positions, seeds and KV slots, no finished request ever rides in a
speculative step, and the KV slots of rejected drafts are freed only after the step that wrote them was waited
for (no in-flight step can touch them). Requests that do not draft (adaptive off, grammar rows, batch
above disable_by_batch_size) keep the one-step lag.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import Req
from ..speculative.ngram import propose_ngram

if TYPE_CHECKING:
    from .scheduler import Scheduler

EMA_WEIGHT = 0.3          # weight of the newest verified run in a request's acceptance estimate
PROBE_EVERY = 16          # a request whose drafts do not pay drafts one token again after this many steps,
MAX_PROBE_GAP = 256       # doubling after each probe that accepted nothing (a probe in the overlap loop costs a sync)
# Cost of one more row in a decode step, as a fraction of a one-row step: measured on SmolLM2-135M Q4_1, 2 cores,
# serial loop, verify steps of one request whose drafts are all rejected: 4 drafts cost 1.82x a plain step, 8
# drafts 2.52x (0.20 and 0.19 a row; host work included, on a shared machine). Decode rows of other requests cost
# less (benchmarks/RESULTS.md, tok/s vs concurrency: 4 rows 1.41x one row): this errs on the side of not drafting.
ROW_COST = 0.2
# Rows a verify step carries at most: up to here the native decode path keeps its few-row kernels (the quantized
# linear computes rows in-kernel up to 96, SiLU x up is the native op up to 64 rows), as a plain decode step does.
MAX_VERIFY_ROWS = 64


def may_draft(req: Req) -> bool:
    """Grammar rows never draft: their masks depend on every token before (a mask per draft position is not
    built). Penalized rows do: a draft row counts the drafts before its position (device/penalties.py)."""
    return req.grammar is None and req.params.structured_outputs is None


def acceptance(req: Req) -> float:
    """Estimated chance that a draft is accepted given the ones before it were: accepted drafts over draft
    trials (accepted + the first rejected one), both as EMAs over the request's verified runs."""
    return req.spec_acc / req.spec_trials


def draft_len(s: "Scheduler", req: Req, batch: int) -> int:
    """Adaptive k: draft the j-th token only while p^j, the chance it is reached and accepted, exceeds what its
    row costs in tokens of the plain step, ROW_COST * B / (1 + ROW_COST * (B - 1)) at B decode requests (one row's
    time at the plain step's rate). So k shrinks as acceptance falls or the batch grows, and is 0 once drafts do
    not pay (then a probe draft after PROBE_EVERY steps, the gap doubling while probes fail, re-measures it).
    Never past max_tokens."""
    cfg = s.config.speculative_config
    limit = req.max_new_tokens() - len(req.output_ids) - 1
    p, cost = acceptance(req), ROW_COST * batch / (1 + ROW_COST * (batch - 1))
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


def propose(s: "Scheduler", reqs: list[Req]) -> tuple[list[Req], dict[Req, list[int]]]:
    """The decode candidates (re-read if host truth had to be brought up to date) and their drafts."""
    cfg = s.config.speculative_config
    if cfg is None or len(reqs) > cfg.disable_by_batch_size or s.max_draft_rows == 0:
        return reqs, {}
    want = {r: k for r in reqs if may_draft(r) and (k := draft_len(s, r, len(reqs))) > 0}
    if not want:
        return reqs, {}              # nobody drafts: the overlap loop keeps its one-step lag
    if s.result_queue:
        s.process_pending()          # the invariant above: drafts are proposed from host truth
        from .pick import _decode_candidates
        reqs = _decode_candidates(s)
    drafts: dict[Req, list[int]] = {}
    room = min(s.max_draft_rows, s.available() - len(reqs), MAX_VERIFY_ROWS - len(reqs))   # slots and rows
    with s.recorder.span("propose"):
        if cfg.method == "draft_model" and s.drafter is not None:
            asked = {}
            for req in reqs:
                k = min(want.get(req, 0), room, req.max_new_tokens() - len(req.output_ids) - 1)
                if k >= 1:
                    asked[req] = k
                    room -= k
            return reqs, s.drafter.propose(asked)
        for req in reqs:
            k = min(want.get(req, 0), room, req.max_new_tokens() - len(req.output_ids) - 1)
            if k < 1:
                continue
            d = propose_ngram(req.fill_ids(), k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if d:
                drafts[req] = d
                room -= len(d)
            else:
                if req.spec_probing:  # a probe that found nothing to propose failed too
                    req.spec_probing = False
                    req.spec_probe_gap = min(2 * req.spec_probe_gap, MAX_PROBE_GAP)
                if s.config.scheduler == "overlap":
                    _update(req, 0, 1)    # a miss cost the overlap (host truth was fetched for nothing)
    return reqs, drafts


def _update(req: Req, accepted: int, trials: int) -> None:
    req.spec_acc = (1 - EMA_WEIGHT) * req.spec_acc + EMA_WEIGHT * accepted
    req.spec_trials = (1 - EMA_WEIGHT) * req.spec_trials + EMA_WEIGHT * trials


def settle(s: "Scheduler", req: Req, k: int, accepted: int) -> None:
    """A verified run of `k` drafts, `accepted` of them kept: free the KV slots of the rejected ones (the step
    that wrote them has been waited for, and no other step is in flight: the invariant above), and count."""
    rejected = k - accepted
    if rejected:
        s.kv.free(req.slots[-rejected:])
        del req.slots[-rejected:]
    req.filled = req.kv_committed = req.allocated
    s.spec_draft_tokens += k
    s.spec_accepted_tokens += accepted
    s.spec_accepted_hist[accepted] = s.spec_accepted_hist.get(accepted, 0) + 1
    _update(req, accepted, accepted + (accepted < k))
    if req.spec_probing:               # a probe: back off while they fail, back to the first gap once one pays
        req.spec_probing = False
        req.spec_probe_gap = PROBE_EVERY if accepted else min(2 * req.spec_probe_gap, MAX_PROBE_GAP)
