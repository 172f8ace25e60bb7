"""Pick batch: admission and prefill chunks (within a hard per-step token budget and the KV memory), with
the running requests' decode tokens in the same step (mixed) or on their own, and retraction when decode
runs out of KV slots.

Host state may lag the device by one step (overlap loop): lengths here are `allocated`, which counts the
in-flight step's KV slot, `filled`, which counts launched prefill chunks, and `num_launched`, which counts
the in-flight token.

Pipeline parallelism (pp_size > 1, the PP loop): decode rows are picked only from requests in no in-flight
micro-batch (Scheduler.in_flight), at most 1/pp_size of the decoding requests, so that pp_size micro-batches
of about equal size keep every stage busy. A started prefill's next chunk is the exception (the chunked
pipeline): it needs no sampled token, and every stage runs micro-batches in launch order, so chunk j+1
reaches a stage after chunk j wrote its KV there; the chunks of one long prompt occupy several stages at once.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..memory.radix_cache import common_prefix
from ..request import Req, ReqStatus
from .batch import Batch, Chunk, InFlight
from .make_batch import make_batch
from .results import process_pending
from .speculative import must_sync, propose

if TYPE_CHECKING:
    from .scheduler import Scheduler

NEW_TOKEN_CLIP = 256        # cap on a request's future tokens counted when reserving KV for admission
IN_BATCH_SHARE = 32         # uncached tokens a request shares with a batch mate that defer it one step


def pick_batch(s: "Scheduler") -> Batch | None:
    if must_sync(s):
        # A step picked after a speculative one assumes its runs are accepted whole (scheduler/speculative.py);
        # a request that may not be picked on that assumption needs its accepted count first.
        s.spec.stats.syncs += 1
        process_pending(s)
    s.expire()                  # deadlines: before anything is picked (Scheduler.expire states the invariant)
    s.finish_idle_aborts()
    if s.grammars is not None:
        s.grammars.collect(s.fail)
    s.policy.order(s.waiting, s.clock())
    if s.policy.preempts and s.waiting:
        preempt(s)
    decode = s.decode_candidates()
    lead = prefill_lead(s)
    if lead is not None:          # the policy's step rule (policy.lead): nothing the lead outranks rides along
        t = s.clock()
        decode = [r for r in decode if not s.policy.outranks(lead, r, t)]
    mixed = s.config.enable_mixed_chunk and bool(decode)
    budget = min(s.config.max_prefill_tokens, s.config.mixed_prefill_tokens) if mixed else \
        s.config.max_prefill_tokens
    chunks = pick_prefill(s, budget, lead)
    if chunks:
        # Mixed step: the decode rows ride along if their slots are there; retraction needs host truth and
        # is left to the next decode-only step.
        decode = decode if mixed and s.available() >= len(decode) else []
        batch = make_batch(s, chunks, _alloc_decode(s, decode))
        charge(s, chunks, decode)
        # Optional hook: a prefill right behind a prefill waits for k-1 first (better TTFT, less overlap).
        batch.needs_previous = s.config.process_prev_before_prefill and any(
            b.is_prefill for b, _ in s.result_queue)
        return batch
    return pick_decode(s)


def _decode_reserve(s: "Scheduler", reqs: list[Req]) -> int:
    """KV the running requests are expected to still need (scaled by new_token_ratio, as in SGLang)."""
    left = sum(min(r.max_new_tokens() - r.num_launched, NEW_TOKEN_CLIP) for r in reqs)
    return int(left * s.new_token_ratio)


def prefill_lead(s: "Scheduler") -> Req | None:
    """The policy's lead among the prefills that could run now: the started ones and the first ready waiting
    one (pick_batch has put the queue in the policy's order, so it is the best waiting); None where the policy
    has no step rule."""
    if not s.policy.ranks_steps:
        return None
    ready = next((r for r in s.waiting if s.grammars is None or s.grammars.ready(r)), None)
    started = [r for r in s.running if r.prefilling and not r.aborted]
    return s.policy.lead(started + ([ready] if ready else []), s.clock())


def pick_prefill(s: "Scheduler", budget: int, lead: Req | None = None, held: InFlight | None = None) -> list[Chunk]:
    """Prefill chunks of at most `budget` tokens in all: a started chunked prefill first, then admissions;
    but once a chunk, arrivals whose whole prefill fits go first, alone, for one step. No chunk of a request
    the `lead` outranks (the policy's step rule, pick_batch). `held`: an urgent pick (urgent.py): no request
    in flight, and no admission whose prefix hit reads a slot a step in flight writes.

    A request is admitted whole (its prompt's KV is allocated at once, so a chunked prefill never stalls for
    memory) and prefilled in chunks: it keeps its row and KV across chunks and joins decode after its last.
    """
    while s.waiting and len(s.waiting[0].fill_ids()) + 1 > s.memory.num_slots:
        # Retracted after growing to the whole cache: it can never be resumed.
        s.end(s.waiting.popleft(), "length")
    chunks: list[Chunk] = []
    tokens = 0
    t = s.clock()

    def outranked(req: Req) -> bool:
        return lead is not None and s.policy.outranks(lead, req, t)
    started = [r for r in s.running if r.prefilling and not r.aborted and not outranked(r)   # in flight or not
               and (held is None or id(r) not in held.reqs)]
    # Arrivals go first for one step, once per chunk of a started prefill: a short request behind a long prompt
    # waits for the chunk in flight, not also for the next chunk in the step that would carry it.
    aside = bool(s.waiting) and bool(started) and not any(r.stood_aside for r in started)
    if not aside:
        tokens = _continue_started(started, chunks, budget)
    decode_reserve = _decode_reserve(s, s.running)
    admitted: list[Req] = []
    reserved = 0
    for req in s.waiting:
        if (tokens >= budget or len(s.running) + len(admitted) >= s.config.max_running_requests or outranked(req)
                or len(admitted) >= s.memory.rows.available()):   # (rows: some may wait for a step, urgent.py)
            break                                 # (the queue is in the policy's order: the rest are outranked too)
        if s.grammars is not None and not s.grammars.ready(req):
            continue                              # its grammar still compiles: the requests behind it go on
        if held is not None and id(req) in held.reqs:
            break                                 # retracted, its rows still in flight (urgent.py): after them
        fill = req.fill_ids()
        cached = s.memory.match_prefix(req)              # locks the hit, so it no longer counts as evictable
        if held is not None and not held.slots.isdisjoint(req.slots[:cached]):
            s.memory.unmatch(req)                 # its hit is still being written: after that step, not in it
            break
        n = len(fill) - cached                    # tokens this prefill computes
        mates = [c.req for c in chunks] + (started if aside else [])
        if s.memory.takes_hits(req) and any(common_prefix(fill, m.fill_ids()) - cached >= IN_BATCH_SHARE
                                              for m in mates):
            # A batch mate computes the same uncached prefix in this step: wait one step and hit its KV
            # (a burst of requests behind one system prompt computes it once, not once per step's admission).
            # Not one that takes no hits (memory.takes_hits): it would wait for nothing.
            s.memory.unmatch(req)
            break
        if aside and n > budget - tokens:
            # Standing aside is for arrivals whose whole prefill fits this step; a long one queues behind.
            s.memory.unmatch(req)
            break
        future = int(min(req.max_new_tokens() - len(req.output_ids), NEW_TOKEN_CLIP) * s.new_token_ratio)
        avail = s.available()                     # net of the slots already given to `admitted`
        if not s.running and not admitted:
            fits = n + 1 <= avail      # alone it needs its prompt and one token; retraction handles the rest
        else:
            fits = n + reserved + future <= avail - decode_reserve
        if not fits:
            s.memory.unmatch(req)
            break
        s.memory.admit(req, n, cached)            # its uncached slots; counts the prefix lookup
        admitted.append(req)
        reserved += future
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
            req.queue_time = s.clock() - req.arrival_time
        take = min(n, budget - tokens)
        chunks.append(Chunk(req, cached, take, take == n))
        tokens += take
    for req in admitted:
        s.waiting.remove(req)                     # a prefix of the queue, but for requests whose grammar compiles
        req.queue_deadline = math.inf             # admitted: max_queue_time no longer applies (a retraction neither)
        req.row = s.memory.rows.alloc()
        req.status = ReqStatus.RUNNING
        s.running.append(req)
    if aside and admitted:
        for req in started:
            req.stood_aside = True
    elif aside:                                   # nobody could be admitted: the started prefills go on now
        _continue_started(started, chunks, budget - tokens)
    return chunks


def _continue_started(started: list[Req], chunks: list[Chunk], budget: int) -> int:
    """The next chunks of started prefills within `budget` tokens, appended to `chunks`; the tokens used.
    The next chunk may be launched while the previous one is still in flight: its ids are host prompt ids (no
    FutureMap read), and the device runs steps in launch order, so the chunks of one row are written in order
    and chunk j+1 attends over the KV chunk j wrote."""
    tokens = 0
    for req in started:
        if tokens >= budget:
            break
        n = min(req.allocated - req.filled, budget - tokens)
        chunks.append(Chunk(req, req.filled, n, req.filled + n == req.allocated))
        req.stood_aside = False
        tokens += n
    return tokens



def pick_decode(s: "Scheduler") -> Batch | None:
    reqs = s.decode_candidates()
    if not reqs:
        return None
    if s.available() < len(reqs):
        # Retraction needs host truth (the tokens of batch k-1): process the pending result first.
        process_pending(s)
        reqs = _retract(s, s.decode_candidates())
        if not reqs:
            return None
    reqs, drafts, bonus = propose(s, reqs)       # drafts only where their KV slots are there
    if not reqs:
        return None
    batch = make_batch(s, [], _alloc_decode(s, reqs, drafts), drafts, bonus)
    charge(s, [], reqs)
    return batch


def charge(s: "Scheduler", chunks: list[Chunk], decode: list[Req]) -> None:
    """The tokens a picked step computes, to each request's account (the fair policy's counters)."""
    for c in chunks:
        s.policy.charge(c.req, c.n, 0)
    for req in decode:
        s.policy.charge(req, 0, 1)


def preempt(s: "Scheduler", held: InFlight | None = None) -> None:
    """Preemption (priority, fair): the first waiting request that may be admitted (its grammar ready) but for
    the running cap or the KV memory retracts the running requests the policy gives it (policy.victims), in
    that order, until it fits; none is
    retracted when even all of them would not make room. Retraction needs host truth (process_pending first),
    and retracted requests keep their outputs, which they re-prefill when they resume (Scheduler.retract).

    `held`: an urgent pick (urgent.py), the steps in flight go on. A victim's rows in them are dropped instead
    (batch.dropped: host truth is the processed steps'), and its KV and row come back only once they are
    processed (Scheduler._release), so only the running cap counts as room made, and a free row is needed."""
    req = next((r for r in s.waiting if s.grammars is None or s.grammars.ready(r)), None)
    if req is None or (held is not None and not s.memory.rows.available()):
        return
    t = s.clock()
    need = len(req.fill_ids()) + int(min(req.max_new_tokens() - len(req.output_ids), NEW_TOKEN_CLIP)
                                      * s.new_token_ratio)

    def fits(running: list[Req], freed: int) -> bool:
        return (len(running) < s.config.max_running_requests
                and (not running or need <= s.available() + freed - _decode_reserve(s, running)))
    if fits(s.running, 0):
        return
    victims = s.policy.victims(req, [r for r in s.running if not r.aborted], t, s.config.max_running_requests)
    keep, freed, chosen = list(s.running), 0, []
    for v in victims:
        if fits(keep, freed):
            break
        keep.remove(v)
        freed += len(v.slots) if held is None or id(v) not in held.reqs else 0
        chosen.append(v)
    if not chosen or not fits(keep, freed):
        return
    if held is None:
        process_pending(s)
    else:
        for b, _ in s.result_queue:
            b.dropped.update(v for v in chosen if v in b.reqs)
    for v in chosen:
        if v in s.running and not v.finished:     # processing k-1 may have finished it
            s.retract(v)
    s.policy.order(s.waiting, t)                  # the retracted behind the request they made room for


def _alloc_decode(s: "Scheduler", reqs: list[Req], drafts: dict[Req, list[int]] | None = None) -> list[Req]:
    """One KV slot per decode row: a request's own token and each of its draft tokens."""
    for req in reqs:
        req.slots.extend(s.memory.alloc_slots(1 + len(drafts.get(req, ())) if drafts else 1))
        req.filled = req.allocated
    return reqs


def _retract(s: "Scheduler", reqs: list[Req]) -> list[Req]:
    """Free the KV of the requests with the fewest outputs (latest first on ties) until decode fits.
    Requests still prefilling hold KV too and are candidates (their launched chunks go to the cache)."""
    pool = reqs + [r for r in s.running if r.prefilling and not r.aborted]
    order = s.policy.retract_order(pool, s.clock())
    retracted = 0
    while s.available() < len(reqs):
        victims = [r for r in order if r not in reqs or len(reqs) > 1]
        if not victims:
            break
        victim = victims[0]
        order.remove(victim)
        if victim in reqs:
            reqs.remove(victim)
        s.retract(victim)
        retracted += 1
    if s.available() < len(reqs):
        # A lone request that holds every slot: it has reached the memory's length.
        s.end(reqs[0], "length")
        return []
    if retracted:
        s.new_token_ratio = min(1.0, s.new_token_ratio + 0.3)
    return reqs
