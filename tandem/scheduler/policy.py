"""Who goes first: the scheduling policy (--scheduling-policy), given to the Scheduler and asked by pick.py.

- fcfs: arrival order; a retracted request goes back to the head of the queue. Nothing is preempted for a
  waiting request (retraction happens only when decode runs out of KV, pick._retract).
- priority: a request's `priority` (lower first, vLLM's sign), then arrival. Aging: a request's rank is its
  priority minus the seconds since its arrival over `priority_aging`, so a low-priority request rises one level
  per `priority_aging` seconds and none starves: every request arriving `priority_aging` x k seconds after it
  ranks k levels worse (all age alike, so two ranks differ by a constant and the order never flips back). A
  waiting request that cannot be admitted (running cap or KV) retracts running requests of a worse rank (the
  existing retraction: their outputs are unchanged when they resume); a retracted request keeps its arrival, so
  it keeps its place among the waiting. The step follows the rank too: a step that prefills a request (its
  `lead`, the best-ranked prefill to run) carries no prefill chunk or decode row the lead outranks, so a
  high-priority prompt is computed in a step of its own rank, not beside a flood's chunks and streams. And the
  overlap loop picks the step after a prefill step once that step has ended (ranks_steps), so an
  arrival waits for at most the long step in flight, not also for one picked behind it; and not for that one
  either where it outranks its chunks: it is prefilled between two of its layers (urgent.py).
- fair: virtual token counters (VTC, Sheng et al., OSDI '24) per tenant (a request's `user`): each prefill
  token adds `fair_prefill_weight`, each decode token `fair_decode_weight`, divided by the tenant's weight
  (`fair_weights`). Admission takes the waiting tenant with the smallest counter first; retraction for KV takes
  the running request of the tenant with the largest first. A tenant that comes back after its queue emptied
  starts at the smallest counter among the tenants that have requests (no credit banked while away). The
  running set (so the decode batch) follows the counters too: a waiting request that cannot be admitted retracts
  running requests of tenants with a larger counter that hold more than their share of the running rows
  (max_running_requests split by weight among the tenants running or asking), never below that share, so a
  flood that filled every row before the others arrived gives rows back at once, and no two tenants can take
  rows back and forth (each keeps its share).

Every method is a pure function of the queues and the clock `t` the scheduler passes: no state but the fair
counters, which change only through charge().
"""
from __future__ import annotations

import collections
import heapq
from typing import Iterable

from ..request import Req

POLICIES = ("fcfs", "priority", "fair")


class FCFS:
    name = "fcfs"
    preempts = False
    # The step rule (priority): a prefill step carries nothing its lead outranks (lead()), and the overlap loop
    # waits for a prefill step in flight before its next pick.
    ranks_steps = False

    def order(self, waiting: collections.deque[Req], t: float) -> None:
        """Put the waiting queue in admission order (in place)."""

    def retract_order(self, pool: list[Req], t: float) -> list[Req]:
        """Decode out of KV: who is retracted first. The fewest outputs, the latest arrival first on ties."""
        return sorted(pool, key=lambda r: (len(r.output_ids), -r.arrival_time))

    def outranks(self, req: Req, other: Req, t: float) -> bool:
        """Does `req` go strictly before `other` (a level better)? Then `other` may be retracted for it and
        does not share a step it prefills in."""
        return False

    def victims(self, req: Req, running: list[Req], t: float, cap: int) -> list[Req]:
        """The running requests waiting `req` may retract to be admitted, in the order they go (`cap`: the
        running rows, max_running_requests)."""
        return []

    def lead(self, reqs: Iterable[Req], t: float) -> Req | None:
        """The request a prefill step is picked for: the step carries nothing it outranks. None: no such
        rule (fcfs, fair: every prefill and decode row may share a step)."""
        return None

    def charge(self, req: Req, prefill: int, decode: int) -> None:
        """Tokens a picked step computes for `req` (the fair policy's counters)."""

    def lift(self, active: Iterable[Req], req: Req) -> None:
        """A request arrives while `active` are in the engine (the fair policy's counter lift)."""


class Priority(FCFS):
    name = "priority"
    preempts = True
    ranks_steps = True

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s          # seconds of waiting that raise a request one priority level

    def rank(self, req: Req, t: float) -> float:
        """Lower goes first: priority, improved by one level per aging_s since arrival."""
        return req.params.priority - (t - req.arrival_time) / self.aging_s

    def order(self, waiting: collections.deque[Req], t: float) -> None:
        _sort(waiting, lambda r: (self.rank(r, t), r.arrival_time))

    def retract_order(self, pool: list[Req], t: float) -> list[Req]:
        return sorted(pool, key=lambda r: (-self.rank(r, t), len(r.output_ids), -r.arrival_time))

    def outranks(self, req: Req, other: Req, t: float) -> bool:
        # Strictly better by a whole level: equal priorities never preempt each other, whatever their ages.
        return self.rank(req, t) <= self.rank(other, t) - 1

    def victims(self, req: Req, running: list[Req], t: float, cap: int) -> list[Req]:
        return [r for r in self.retract_order(running, t) if self.outranks(req, r, t)]

    def lead(self, reqs: Iterable[Req], t: float) -> Req | None:
        return min(reqs, key=lambda r: (self.rank(r, t), r.arrival_time), default=None)


class Fair(FCFS):
    name = "fair"
    preempts = True

    def __init__(self, weights: dict[str, float], prefill_weight: float, decode_weight: float) -> None:
        self.weights, self.prefill_weight, self.decode_weight = weights, prefill_weight, decode_weight
        self.counters: dict[str, float] = {}     # tenant -> virtual tokens served / its weight

    @staticmethod
    def tenant(req: Req) -> str:
        return req.params.user or ""

    def order(self, waiting: collections.deque[Req], t: float) -> None:
        """Tenants interleaved as VTC admits them: the tenant with the smallest counter, projected with the
        prefills of the requests already ordered before, gives its earliest waiting request next."""
        queues: dict[str, collections.deque[Req]] = {}
        for r in sorted(waiting, key=lambda r: r.arrival_time):
            queues.setdefault(self.tenant(r), collections.deque()).append(r)
        # (projected counter, its next request's arrival, tenant): O(n log tenants) for n waiting requests
        heap = [(self.counters.get(u, 0.0), q[0].arrival_time, u) for u, q in queues.items()]
        heapq.heapify(heap)
        waiting.clear()
        while heap:
            projected, _, u = heapq.heappop(heap)
            r = queues[u].popleft()
            waiting.append(r)
            if queues[u]:
                projected += len(r.fill_ids()) * self.prefill_weight / self.weights.get(u, 1.0)
                heapq.heappush(heap, (projected, queues[u][0].arrival_time, u))

    def lift(self, active: Iterable[Req], req: Req) -> None:
        """A request arrives: its tenant, if it has none in the engine, starts no lower than the smallest
        counter of the tenants that have (VTC's counter lift: no credit banked while away)."""
        u = self.tenant(req)
        others = {self.tenant(r) for r in active}
        if u in others:
            return
        floor = min((self.counters.get(v, 0.0) for v in others), default=None)
        if floor is not None:
            self.counters[u] = max(self.counters.get(u, 0.0), floor)

    def retract_order(self, pool: list[Req], t: float) -> list[Req]:
        return sorted(pool, key=lambda r: (-self.counters.get(self.tenant(r), 0.0), len(r.output_ids),
                                           -r.arrival_time))

    def victims(self, req: Req, running: list[Req], t: float, cap: int) -> list[Req]:
        """Requests of tenants with a larger counter than req's that hold more than their share of the rows,
        the largest counter first, each tenant kept at its share."""
        u = self.tenant(req)
        rows = collections.Counter(self.tenant(r) for r in running)
        asking = set(rows) | {u}
        total = sum(self.weights.get(v, 1.0) for v in asking)
        mine = self.counters.get(u, 0.0)
        out = []
        for r in self.retract_order(running, t):
            v = self.tenant(r)
            if v == u or self.counters.get(v, 0.0) <= mine or rows[v] - 1 < cap * self.weights.get(v, 1.0) / total:
                continue
            rows[v] -= 1
            out.append(r)
        return out

    def charge(self, req: Req, prefill: int, decode: int) -> None:
        u = self.tenant(req)
        self.counters[u] = self.counters.get(u, 0.0) + \
            (prefill * self.prefill_weight + decode * self.decode_weight) / self.weights.get(u, 1.0)


def _sort(waiting: collections.deque[Req], key) -> None:
    items = sorted(waiting, key=key)
    waiting.clear()
    waiting.extend(items)


def parse_weights(spec: str | None) -> dict[str, float]:
    """--fair-weights "alice=2,bob=0.5" -> {"alice": 2.0, "bob": 0.5}, or "@FILE": the same pairs in a file, one
    or more a line ("#" starts a comment); ValueError naming the bad part."""
    weights: dict[str, float] = {}
    if spec is not None and spec.startswith("@"):
        try:
            with open(spec[1:]) as f:
                spec = ",".join(line.split("#", 1)[0].strip() for line in f)
        except OSError as e:
            raise ValueError(f"fair_weights: cannot read {spec[1:]!r}: {e.strerror}") from None
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.rpartition("=")
        try:
            w = float(value)
        except ValueError:
            w = -1.0
        if not sep or not name.strip() or not 0 < w < float("inf"):
            raise ValueError(f"fair_weights must be 'TENANT=WEIGHT,...' with weights > 0, got {part!r}")
        weights[name.strip()] = w
    return weights


def make_policy(config) -> FCFS:
    """The policy an EngineConfig names."""
    if config.scheduling_policy == "priority":
        return Priority(config.priority_aging)
    if config.scheduling_policy == "fair":
        return Fair(parse_weights(config.fair_weights), config.fair_prefill_weight, config.fair_decode_weight)
    return FCFS()
