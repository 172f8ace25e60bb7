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

import enum
import math
from typing import TYPE_CHECKING

from ..memory.radix_cache import common_prefix
from ..request import Req, ReqStatus
from .batch import NO_FENCE, Batch, Chunk, Fence
from .make_batch import make_batch
from .results import process_pending
from .speculative import must_sync, propose

if TYPE_CHECKING:
    from .scheduler import Scheduler

NEW_TOKEN_CLIP = 256        # cap on a request's future tokens counted when reserving KV for admission
IN_BATCH_SHARE = 32         # uncached tokens a request shares with a batch mate that defer it one step
# Tokens restored from the disk tier that cost the step's budget one prefill token: reading, checking and copying a
# token's KV back takes a few tens of microseconds where computing it takes ~1 ms (SmolLM2) to ~7 ms (1.5B) on 2 cores
RESTORED_PER_TOKEN = 32


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


def first_ready(s: "Scheduler") -> Req | None:
    """The first waiting request that may be admitted now: its grammar compiled (the best waiting one, where the
    queue is in the policy's order)."""
    return next((r for r in s.waiting if ready(s, r)), None)


def ready(s: "Scheduler", req: Req) -> bool:
    """Its grammar, if any, has compiled (grammar.py); a request whose grammar still compiles waits."""
    return s.grammars is None or s.grammars.ready(req)


def started_prefills(s: "Scheduler") -> list[Req]:
    """Running requests with prompt chunks still to compute (a chunked prefill), in flight or not."""
    return [r for r in s.running if r.prefilling and not r.aborted]


def future_tokens(s: "Scheduler", req: Req) -> int:
    """The tokens a waiting `req` is expected to still write, clipped and scaled by new_token_ratio (as in
    SGLang): the KV admission and preemption reserve for it."""
    return int(min(req.max_new_tokens() - len(req.output_ids), NEW_TOKEN_CLIP) * s.new_token_ratio)


def decode_reserve(s: "Scheduler", reqs: list[Req]) -> int:
    """KV the running requests are expected to still need."""
    return int(sum(min(r.max_new_tokens() - r.num_launched, NEW_TOKEN_CLIP) for r in reqs) * s.new_token_ratio)


def fits(s: "Scheduler", need: int, reserve: int, freed: int = 0) -> bool:
    """The room rule admission and preemption share: `need` KV slots for a request beside `reserve` (what the
    requests running or admitted before it are expected to still need), within the slots available (plus the
    `freed` slots of a preemption's victims). Admission counts a request's uncached tokens once its prefix hit
    is locked; preemption, before any match, its whole prompt against slots among which an unlocked hit still
    counts as evictable: the same room, but for a hit another running request holds locked, which preemption
    asks room for again (it may retract one victim more than admission needs; a lookup that does not lock
    would close that)."""
    return need + reserve <= s.available() + freed


def prefill_lead(s: "Scheduler") -> Req | None:
    """The policy's lead among the prefills that could run now: the started ones and the first ready waiting
    one (pick_batch has put the queue in the policy's order, so it is the best waiting); None where the policy
    has no step rule."""
    if not s.policy.ranks_steps:
        return None
    ready_one = first_ready(s)
    return s.policy.lead(started_prefills(s) + ([ready_one] if ready_one else []), s.clock())


def pick_prefill(s: "Scheduler", budget: int, lead: Req | None = None, fence: Fence = NO_FENCE) -> list[Chunk]:
    """Prefill chunks of at most `budget` tokens in all: a started chunked prefill first, then admissions;
    but once a chunk, arrivals whose whole prefill fits go first, alone, for one step (PrefillAdder)."""
    while s.waiting and len(s.waiting[0].fill_ids()) + 1 > s.memory.num_slots:
        # Retracted after growing to the whole cache: it can never be resumed.
        s.end(s.waiting.popleft(), "length")
    adder = PrefillAdder(s, budget, lead, fence)
    if not adder.aside:
        adder.continue_started()
    for req in s.waiting:
        if adder.add(req) is Verdict.STOP:
            break                                 # (the queue is in the policy's order: the rest wait too)
    return adder.commit()


class Verdict(enum.Enum):
    ADMIT = "admit"       # its chunk joins the step
    SKIP = "skip"         # not now; the requests behind it may go (its grammar still compiles)
    STOP = "stop"         # not now, nor anyone behind it (the queue is in the policy's order)


class PrefillAdder:
    """One step's prefill admissions (SGLang's PrefillAdder): the budget, the tokens taken, the KV reserved, the
    chunks and the admitted. continue_started() takes the started prefills' next chunks; add(req) answers ADMIT,
    SKIP or STOP for a waiting request, one named guard a rule, and undoes a refused request's prefix match in
    one place; commit() moves the admitted into running.

    A request is admitted whole (its prompt's KV is allocated at once, so a chunked prefill never stalls for
    memory) and prefilled in chunks: it keeps its row and KV across chunks and joins decode after its last.
    `lead`: no chunk of a request it outranks (the policy's step rule, pick_batch). `fence`: an urgent pick's
    (urgent.py): no request in flight, and no admission whose prefix hit reads a slot a step in flight writes."""

    def __init__(self, s: "Scheduler", budget: int, lead: Req | None = None, fence: Fence = NO_FENCE) -> None:
        self.s, self.budget, self.lead, self.fence = s, budget, lead, fence
        self.t = s.clock()
        self.chunks: list[Chunk] = []
        self.tokens = 0                           # of the budget, taken
        self.admitted: list[Req] = []
        self.reserved = 0                         # the future tokens of the admitted (future_tokens)
        self.decode_reserve = decode_reserve(s, s.running)
        self.started = [r for r in started_prefills(s) if not self.outranked(r) and r not in fence]
        # Arrivals go first for one step, once per chunk of a started prefill: a short request behind a long
        # prompt waits for the chunk in flight, not also for the next chunk in the step that would carry it.
        self.aside = bool(s.waiting) and bool(self.started) and not any(r.stood_aside for r in self.started)

    def continue_started(self) -> None:
        """The next chunks of the started prefills within the budget left.
        The next chunk may be launched while the previous one is still in flight: its ids are host prompt ids
        (no FutureMap read), and the device runs steps in launch order, so the chunks of one row are written in
        order and chunk j+1 attends over the KV chunk j wrote."""
        for req in self.started:
            if self.tokens >= self.budget:
                break
            n = min(req.allocated - req.filled, self.budget - self.tokens)
            self.chunks.append(Chunk(req, req.filled, n, req.filled + n == req.allocated))
            req.stood_aside = False
            self.tokens += n

    def add(self, req: Req) -> Verdict:
        """The guards below, in this order: a refusal before the prefix match costs nothing to undo."""
        if self.step_full() or self.outranked(req):
            return Verdict.STOP
        if not ready(self.s, req):
            return Verdict.SKIP
        if req in self.fence:
            return Verdict.STOP                   # retracted, its rows still in flight (urgent.py): after them
        cached = self.s.memory.match_prefix(req)  # locks the hit, so it no longer counts as evictable
        fill = req.fill_ids()
        n = len(fill) - cached                    # tokens this prefill computes
        future = future_tokens(self.s, req)       # tokens it is expected to write after them
        if (self.hit_in_flight(req, cached) or self.mate_computes_it(req, fill, cached)
                or self.too_long_to_stand_aside(n) or not self.fits(n, future)):
            self.s.memory.unmatch(req)            # the one place a refused request's prefix match is undone
            return Verdict.STOP
        self._admit(req, cached, n, future)
        return Verdict.ADMIT

    # ---- the guards, in the order add() asks them -------------------------------------------------------
    def step_full(self) -> bool:
        """The budget is spent, the running cap reached, or no request-table row is free (some may wait for a
        step in flight: urgent.py)."""
        return (self.tokens >= self.budget
                or len(self.s.running) + len(self.admitted) >= self.s.config.max_running_requests
                or len(self.admitted) >= self.s.memory.rows.available())

    def outranked(self, req: Req) -> bool:
        """The step's lead outranks it (the policy's step rule)."""
        return self.lead is not None and self.s.policy.outranks(self.lead, req, self.t)

    def hit_in_flight(self, req: Req, cached: int) -> bool:
        """Its prefix hit is still being written by a step in flight: after that step, not in it."""
        return self.fence.writes(req.slots[:cached])

    def mate_computes_it(self, req: Req, fill: list[int], cached: int) -> bool:
        """A batch mate computes the same uncached prefix in this step: wait one step and hit its KV (a burst of
        requests behind one system prompt computes it once, not once per step's admission). Not one that takes
        no hits (memory.takes_hits): it would wait for nothing."""
        mates = [c.req for c in self.chunks] + (self.started if self.aside else [])
        return self.s.memory.takes_hits(req) and any(
            common_prefix(fill, m.fill_ids()) - cached >= IN_BATCH_SHARE for m in mates)

    def too_long_to_stand_aside(self, n: int) -> bool:
        """Standing aside is for arrivals whose whole prefill fits this step; a long one queues behind."""
        return self.aside and n > self.budget - self.tokens

    def fits(self, n: int, future: int) -> bool:
        """Its `n` tokens' KV (fits()): alone it needs its prompt and one token (retraction handles the rest);
        beside others, also the `future` tokens it and they are expected to still write."""
        if not self.s.running and not self.admitted:
            return fits(self.s, n + 1, 0)
        return fits(self.s, n + future, self.reserved + self.decode_reserve)

    # ---- taking it -----------------------------------------------------------------------------------------
    def _admit(self, req: Req, cached: int, n: int, future: int) -> None:
        s = self.s
        room = self.budget - self.tokens          # >= 1: add() asked step_full first
        if not self.fence:                        # not an urgent pick (KVCacheManager.restore_from_disk says why)
            restored = s.memory.restore_from_disk(req)
            cached, n = cached + restored, n - restored
            self.tokens += -(-restored // RESTORED_PER_TOKEN)    # prefill work, at its measured cost
        s.memory.admit(req, n, cached)            # its uncached slots; counts the prefix lookup
        self.admitted.append(req)
        self.reserved += future
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
            req.queue_time = s.clock() - req.arrival_time
        take = min(n, max(1, self.budget - self.tokens), room)   # a restore's cost leaves its first chunk a token
        self.chunks.append(Chunk(req, cached, take, take == n))
        self.tokens += take

    def commit(self) -> list[Chunk]:
        """Move the admitted into running (each with its request-table row); the step's chunks."""
        s = self.s
        for req in self.admitted:
            s.waiting.remove(req)                 # a prefix of the queue, but for requests whose grammar compiles
            req.queue_deadline = math.inf         # admitted: max_queue_time no longer applies (a retraction neither)
            req.row = s.memory.rows.alloc()
            req.status = ReqStatus.RUNNING
            s.running.append(req)
        if self.aside and self.admitted:
            for req in self.started:
                req.stood_aside = True
        elif self.aside:                          # nobody could be admitted: the started prefills go on now
            self.continue_started()
        return self.chunks


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


def preempt(s: "Scheduler", fence: Fence = NO_FENCE) -> None:
    """Preemption (priority, fair): the first waiting request that may be admitted (its grammar ready) but for
    the running cap or the KV memory (fits()) retracts the running requests the policy gives it (policy.victims),
    in that order, until it fits; none is retracted when even all of them would not make room. Retraction needs
    host truth (process_pending first), and retracted requests keep their outputs, which they re-prefill when
    they resume (Scheduler.retract).

    `fence`: an urgent pick's (urgent.py), the steps in flight go on. A victim's rows in them are dropped instead
    (batch.dropped: host truth is the processed steps'), and its KV and row come back only once they are
    processed (UrgentSteps.defer), so only the running cap counts as room made, and a free row is needed."""
    req = first_ready(s)
    if req is None or (fence and not s.memory.rows.available()):
        return
    t = s.clock()
    need = len(req.fill_ids()) + future_tokens(s, req)

    def room(running: list[Req], freed: int) -> bool:
        return (len(running) < s.config.max_running_requests
                and (not running or fits(s, need, decode_reserve(s, running), freed)))
    if room(s.running, 0):
        return
    victims = s.policy.victims(req, [r for r in s.running if not r.aborted], t, s.config.max_running_requests)
    keep, freed, chosen = list(s.running), 0, []
    for v in victims:
        if room(keep, freed):
            break
        keep.remove(v)
        freed += len(v.slots) if v not in fence else 0
        chosen.append(v)
    if not chosen or not room(keep, freed):
        return
    if not fence:
        process_pending(s)                        # host truth first (an ordinary pick)
    for b, _ in s.result_queue:                   # (an urgent pick's steps in flight: their rows are dropped)
        b.dropped.update(v for v in chosen if v in b.reqs)
    for v in chosen:
        if v in s.running and not v.finished:     # processing k-1 may have finished it
            s.retract(v)
    s.policy.order(s.waiting, t)                  # the retracted behind the request they made room for


def pick_urgent(s: "Scheduler") -> Batch | None:
    """The urgent-step branch's pick (urgent.py), made while a yielding step is in flight: prefill chunks of
    waiting requests led by one that outranks every prefill chunk in flight (the step rule of pick_batch: nothing
    the lead outranks rides along), retracting running requests the lead outranks where the running cap is full;
    None when there is no such lead, or when the next step's buffer slot is still held."""
    queue, urgent = s.result_queue, s.urgent
    if not s.waiting or not urgent.slot_free(queue, s.peek_step_id(), s.executor.buffer_slots):
        return None
    s.expire()                  # deadlines first, as pick_batch
    t = s.clock()
    s.policy.order(s.waiting, t)
    lead = first_ready(s)
    fence = urgent.fence(queue)
    if lead is None or lead in fence or not urgent.outranks_chunks(lead, queue, s.policy.outranks, t):
        return None
    preempt(s, fence)
    chunks = pick_prefill(s, s.config.max_prefill_tokens, lead, fence)
    if not chunks:
        return None
    batch = make_batch(s, chunks, [])
    charge(s, chunks, [])
    batch.urgent = True
    return batch


def _alloc_decode(s: "Scheduler", reqs: list[Req], drafts: dict[Req, list[int]] | None = None) -> list[Req]:
    """One KV slot per decode row: a request's own token and each of its draft tokens."""
    for req in reqs:
        req.slots.extend(s.memory.alloc_slots(1 + len(drafts.get(req, ())) if drafts else 1))
        req.filled = req.allocated
    return reqs


def _retract(s: "Scheduler", reqs: list[Req]) -> list[Req]:
    """Free the KV of the requests with the fewest outputs (latest first on ties) until decode fits.
    Requests still prefilling hold KV too and are candidates (their launched chunks go to the cache)."""
    pool = reqs + started_prefills(s)
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
