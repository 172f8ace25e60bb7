"""The speculative-decoding branch of the scheduler: which decode rows draft (pick batch), and how a verified
run becomes host truth (process results).

A speculating request's k drafts ride as k extra decode rows right after its own (StepInput.draft_lens); the
device samples every row as the plain path samples that output position, and verify.py's rule keeps s_0..s_a.

Loop invariant (enforced in pick_batch and propose): a step that carries drafts is picked and launched only when
no step is in flight (host truth is current), and no step is picked after it until it has been processed. So
under the overlap loop a speculative step runs like a serial one: the host knows every request's accepted
count before it computes the next step's positions, seeds and KV slots, no finished request ever rides in a
speculative step, and the KV slots of rejected drafts are freed only after the step that wrote them was waited
for (no in-flight step can touch them). Requests that do not draft (adaptive off, grammar, penalties, batch
above disable_by_batch_size) keep the one-step lag.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..request import Req
from ..speculative.ngram import propose_ngram

if TYPE_CHECKING:
    from .scheduler import Scheduler

EMA_WEIGHT = 0.3          # weight of the newest step in a request's acceptance EMA
PROBE_EVERY = 16          # a request below the acceptance floor drafts again once per this many steps
FULL_K_EMA = 0.5          # at or above this EMA a request drafts the full k; below, k shrinks in proportion


def may_draft(req: Req) -> bool:
    """Grammar rows never draft (their masks depend on every token before); penalized rows neither (their
    counts would have to include the drafts before each position)."""
    p = req.params
    return (req.grammar is None and p.structured_outputs is None and not p.presence_penalty
            and not p.frequency_penalty and p.repetition_penalty == 1)


def draft_len(s: "Scheduler", req: Req) -> int:
    """Adaptive k: the full num_speculative_tokens while the request's acceptance EMA is high, fewer as it
    falls, none below min_acceptance (but for one probe every PROBE_EVERY steps); never past max_tokens."""
    cfg = s.config.speculative_config
    if req.spec_ema < cfg.min_acceptance:
        req.spec_skipped += 1
        if req.spec_skipped % PROBE_EVERY:
            return 0
    k = cfg.num_speculative_tokens
    if req.spec_ema < FULL_K_EMA:
        k = max(1, math.ceil(k * req.spec_ema / FULL_K_EMA))
    return max(0, min(k, req.max_new_tokens() - len(req.output_ids) - 1))


def propose(s: "Scheduler", reqs: list[Req]) -> tuple[list[Req], dict[Req, list[int]]]:
    """The decode candidates (re-read if host truth had to be brought up to date) and their drafts."""
    cfg = s.config.speculative_config
    if cfg is None or len(reqs) > cfg.disable_by_batch_size or not any(may_draft(r) for r in reqs):
        return reqs, {}
    if s.result_queue:
        s.process_pending()          # the invariant above: drafts are proposed from host truth
        from .pick import _decode_candidates
        reqs = _decode_candidates(s)
    drafts: dict[Req, list[int]] = {}
    room = min(s.max_draft_rows, s.available() - len(reqs))     # KV slots and batch rows for draft tokens
    with s.recorder.span("propose"):
        for req in reqs:
            if not may_draft(req):
                continue
            k = min(draft_len(s, req), room)
            if k < 1:
                continue
            d = propose_ngram(req.fill_ids(), k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if d:
                drafts[req] = d
                room -= len(d)
            elif s.config.scheduler == "overlap":
                _update_ema(req, 0.0)     # a miss cost the overlap (host truth was fetched for nothing)
    return reqs, drafts


def _update_ema(req: Req, rate: float) -> None:
    req.spec_ema = (1 - EMA_WEIGHT) * req.spec_ema + EMA_WEIGHT * rate


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
    _update_ema(req, accepted / k)
