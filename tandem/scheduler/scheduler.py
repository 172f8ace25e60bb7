"""The scheduler: request state of the engine (host side only), composed of the managers it is given.

It owns the queues (inbox, waiting, running, the result queue), a KVCacheManager for memory, and is given the
grammar branch's Grammars, the speculative branch's Speculation and the urgent-step branch's UrgentSteps. What runs a step sits above it and takes it
as an argument: pick.py (pick batch), make_batch.py, launch.py (launch step), results.py (process results) and
loops.py; this module imports none of them.

The device side (weights, KV cache, request table, FutureMap) sits behind `executor`; launch.py sends it index
arrays and results.py reads sampled ids back through result handles.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import traceback
from typing import Callable

import numpy as np

from .. import faults
from ..config import EngineConfig
from ..device.streams import now
from ..device.executor import Executor, ResultHandle
from ..memory.disk_tier import DiskTier
from ..memory.kv_manager import KVCacheManager
from ..memory.state_checkpoints import StateCheckpoints
from ..request import Req, ReqStatus, StepOutput
from ..speculative.speculation import Speculation
from ..trace.recorder import Recorder
from .batch import Batch
from .grammar import Grammars
from .policy import FCFS
from .urgent import UrgentSteps

log = logging.getLogger("tandem.scheduler")

NEW_TOKEN_RATIO_INIT = 0.5
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002


class Scheduler:
    def __init__(self, config: EngineConfig, executor: Executor, sink: Callable[[list[StepOutput]], None],
                 recorder: Recorder | None = None, poll: Callable[[], None] | None = None,
                 grammars: Grammars | None = None, spec: Speculation | None = None,
                 policy: FCFS | None = None, urgent: UrgentSteps | None = None, recurrent: int = 0,
                 disk: DiskTier | None = None) -> None:
        self.config = config
        self.policy = policy or FCFS()      # who goes first: admission order, preemption, retraction (policy.py)
        self.grammars = grammars            # the grammar branch (grammar.py); None: no structured outputs
        self.spec = spec or Speculation()   # the speculative branch's limits, drafter, costs and counts
        self.urgent = urgent or UrgentSteps()   # the urgent-step branch (urgent.py); off by default
        self.poll = poll                    # pulls new messages (e.g. from ZMQ) into the inbox
        self.executor = executor
        self.sink = sink
        self.recorder = recorder or Recorder(enabled=False)
        # Request-table rows: the running cap's, and spare ones urgent steps' requests take (EngineConfig.spare_rows)
        # recurrent: the bytes of the linear-attention state a hybrid model's row holds (model/recurrent_state.py)
        checkpoints = (StateCheckpoints(config.checkpoints(), config.hybrid_checkpoint_tokens)
                       if recurrent and config.checkpoints() else None)
        self.memory = KVCacheManager(executor.num_slots, config.max_running_requests + config.spare_rows(),
                                     config.prefix_cache, checkpoints, recurrent, disk)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.inbox: collections.deque = collections.deque()        # ("add", Req) | ("abort", rid); thread-safe
        self.result_queue: collections.deque[tuple[Batch, ResultHandle]] = collections.deque()
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._next_step_id = 0
        self._live: dict[str, Req] = {}
        self.retractions = 0
        self.failures = 0                   # requests ended by an error in their own path (fail)
        self.expired = 0                    # requests ended by a deadline (max_queue_time, their own timeout)
        self.arrivals = 0                   # requests taken in (a new one may allow an urgent step: wait_long_step)
        self._next_deadline = math.inf      # the earliest deadline of a live request: none is looked at before

    # ---- requests in ---------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a validated request; the loop takes it in at its next recv (thread-safe)."""
        self.inbox.append(("add", req))

    def abort(self, rid: str) -> None:
        """Ask for a request's end; the loop applies it at its next recv (thread-safe)."""
        self.inbox.append(("abort", rid))

    def num_queued(self) -> int:
        """Requests waiting for admission, including those not yet taken from the inbox."""
        return len(self.waiting) + sum(1 for k, _ in list(self.inbox) if k == "add")

    def recv_requests(self) -> None:
        if self.poll is not None:
            self.poll()
        while self.inbox:
            kind, item = self.inbox.popleft()
            if kind == "add":
                self.arrivals += 1
                self._live[item.rid] = item
                try:
                    faults.check("prepare", item.prompt_ids)
                    item.prepare()
                    if item.params.structured_outputs is not None:
                        if self.grammars is None:
                            raise ValueError("this engine has no grammar compiler")
                        self.grammars.submit(item)          # compiled off the loop; admitted once ready
                except Exception as e:             # isolation: this request fails, the engine goes on
                    self.fail(item, e)
                    continue
                self._set_deadlines(item)
                self.policy.lift(itertools.chain(self.running, self.waiting), item)
                self.waiting.append(item)
            elif kind == "abort":
                self._abort(item)

    def _abort(self, rid: str) -> None:
        """Aborts only mark a request; the finish path frees it (never under an in-flight step)."""
        req = self._live.get(rid)
        if req is None or req.finished:
            return
        req.aborted = True
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
            self.end(req, "abort")

    # ---- deadlines -----------------------------------------------------------------------------------------
    def _set_deadlines(self, req: Req) -> None:
        """max_queue_time and the request's own timeout, both counted from its arrival (Req.arrival_time)."""
        if self.config.max_queue_time is not None:
            req.queue_deadline = req.arrival_time + self.config.max_queue_time
        if req.params.timeout is not None:
            req.deadline = req.arrival_time + req.params.timeout
        self._next_deadline = min(self._next_deadline, req.queue_deadline, req.deadline)

    def expire(self) -> None:
        """End the requests whose deadline passed: one still waiting for its first admission past
        max_queue_time (error 503: the server is overloaded, retry later), and one whose own timeout passed,
        waiting or running (error 408). Called by pick_batch before it picks anything; cheap: nothing is looked
        at before the earliest deadline of a live request.

        Invariant: a request ended here frees its memory and never corrupts a batch. A waiting request holds no
        row and no KV (never admitted, or retracted: retract() gave them back), so it is finished at once, as an
        abort of a waiting request is. A running one is only marked, as an abort is: it gets no new row in the
        batch being picked (decode_candidates and the prefill picks skip aborted requests), and it is finished
        by finish_idle_aborts once no launched step holds it, or by process_results when the step that holds it
        is processed, so its row and KV are freed only after every step that reads or writes them
        (Scheduler.finish says why that is safe)."""
        t = now()
        if t < self._next_deadline:
            return
        nxt = math.inf
        for req in [r for r in self.waiting if min(r.queue_deadline, r.deadline) <= t]:
            self.waiting.remove(req)
            self._expire(req, t)
            self.end(req, "error")
        for req in self.running:
            if not req.aborted and req.deadline <= t:
                self._expire(req, t)
                req.aborted = True          # finished with reason "error" (req.error): see finish_idle_aborts
        for req in self._live.values():
            if not req.finished and not req.aborted:
                nxt = min(nxt, req.queue_deadline, req.deadline)
        self._next_deadline = nxt

    def _expire(self, req: Req, t: float) -> None:
        self.expired += 1
        waited = t - req.arrival_time
        if req.deadline <= t:
            req.error_status = 408
            req.error = (f"timeout: the request's timeout of {req.params.timeout:g} s passed "
                         f"({waited:.1f} s since it arrived, {len(req.output_ids)} tokens generated)")
        else:
            req.error_status = 503
            req.error = (f"the request waited {waited:.1f} s in the queue without being admitted "
                         f"(max_queue_time {self.config.max_queue_time:g} s): the engine is overloaded, retry later")
        log.debug("request %s ended: %s", req.rid, req.error)   # expected under overload: no log flood

    def clock(self) -> float:
        """The scheduler's clock (deadlines, priority aging): device.streams.now, on Req.arrival_time's scale."""
        return now()

    def in_flight(self) -> set[int]:
        """ids of the requests in a launched, unprocessed step (PP: at most one micro-batch each, pick.py)."""
        return {id(r) for b, _ in self.result_queue for r in b.reqs}

    def finish_idle_aborts(self) -> None:
        """Finish aborted running requests that no launched, unprocessed step holds."""
        in_flight = self.in_flight()
        for req in [r for r in self.running if r.aborted and id(r) not in in_flight]:
            self.end(req, "error" if req.error is not None else "abort")   # error: its deadline (expire)

    def decode_candidates(self) -> list[Req]:
        """Running requests that may get a decode row now. A request whose launched tokens already reach its
        limit finishes when batch k-1 is processed; one still prefilling joins decode after its last chunk."""
        reqs = [r for r in self.running
                if not r.aborted and not r.prefilling and r.num_launched < r.max_new_tokens()]
        if self.config.pp_size == 1:
            return reqs
        busy = self.in_flight()               # pipeline: at most one in-flight micro-batch per request
        share = -(-len(reqs) // self.config.pp_size)
        return [r for r in reqs if id(r) not in busy][:share]

    def emit(self, outputs: list[StepOutput]) -> None:
        if outputs:
            self.sink(outputs)

    # ---- leaving -------------------------------------------------------------------------------------------
    def finish(self, req: Req, reason: str) -> None:
        """Free a finished request's row, and its KV slots to the prefix cache or the free list.

        Safe even though the request may still ride in the launched batch k (one-step lag): every later
        launch queues behind batch k on the device (one forward stream; one device process that runs steps
        in order), so a freed slot or row, or a cached slot that is evicted, is rewritten only by steps that
        run after batch k's writes and reads.

        Pipeline stages (the PP loop): several micro-batches are in flight, but a request rides in at most
        one, so once micro-batch k is processed none in flight still reads or writes its request's slots or
        row; and every stage runs micro-batches in launch order, so a slot handed to a later launch (freed,
        or evicted from the cache) is rewritten on each stage after every in-flight micro-batch there.

        Urgent steps (urgent.py) run *before the rest of* the long step they are launched in, so "later
        launches run after" does not hold for it: a request that rides in such a step (batch.yields) keeps its
        slots and row until that step has been processed (_release: UrgentSteps.defer).
        """
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self._live.pop(req.rid, None)

    def end(self, req: Req, reason: str) -> None:
        """Finish a request outside process_results (abort, no room left) and tell the sink: no new token."""
        self.finish(req, reason)
        self.emit([StepOutput(req.rid, [], True, reason, None, len(req.prompt_ids), len(req.output_ids),
                              req.error, req.num_cached_tokens or 0, error_status=req.error_status)])

    def fail(self, req: Req, exc: BaseException) -> None:
        """Engine isolation: an error in one request's own path (preparing it, processing its results) ends
        that request alone, with finish_reason "error"; the loop, the device and every other request go on.
        Its KV and row are freed like any finish (the one-step-lag argument of finish() holds)."""
        log.error("request %s failed: %s", req.rid, "".join(traceback.format_exception_only(exc)).strip())
        self.failures += 1
        req.error = f"{type(exc).__name__}: {exc}"
        if req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.end(req, "error")

    def retract(self, req: Req) -> None:
        """Give back a running request's KV; it re-prefills prompt + outputs later (host truth is current)."""
        self.running.remove(req)
        self._release(req)
        self.retractions += 1
        req.status = ReqStatus.WAITING
        req.kv_committed = 0
        req.num_launched = len(req.output_ids)
        req.spec.guess, req.spec.stale = [], False      # nothing in flight; its re-prefill writes the FutureMap
        self.waiting.appendleft(req)    # the head under fcfs; the other policies order by its kept arrival

    def _release(self, req: Req) -> None:
        if not self.urgent.defer(req, self.result_queue):     # urgent steps may run in a step it rides in
            self.release_now(req)

    def release_now(self, req: Req) -> None:
        """Give back a request's KV slots (prefix cache or free list), row and drafter state."""
        if self.spec.drafter is not None:
            self.spec.drafter.release(req)
        self.memory.release(req)

    def available(self) -> int:
        """KV slots a step may get: free, plus cached but unlocked (evictable on demand)."""
        return self.memory.available()

    def reset_prefix_cache(self) -> None:
        self.memory.reset_prefix_cache()

    def audit_kv(self) -> None:
        """Debug check: every KV slot is free, held by a live request, owned by the tree, or a dropped speculative
        row's slot freed once its step is waited for (Batch.release), exactly once."""
        deferred = [r for r in self.urgent.deferred() if r.rid not in self._live]
        self.memory.audit([*self._live.values(), *deferred],
                          [s for batch, _ in self.result_queue for s in batch.release])

    def take_freed_rows(self) -> np.ndarray:
        rows = self.memory.take_freed_rows()
        return np.array(rows if self.config.poison_future_map else [], dtype=np.int64)

    def next_step_id(self) -> int:
        self._next_step_id += 1
        return self._next_step_id - 1

    def peek_step_id(self) -> int:
        """The id the next picked step gets (an urgent pick: which buffer slot it would write)."""
        return self._next_step_id

    # ---- state ---------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting or self.running or self.result_queue)

    def stats(self) -> dict:
        mem = self.memory.stats()
        return {
            **{k: mem[k] for k in ("total_kv_slots", "free_kv_slots", "cached_kv_slots", "evictable_kv_slots",
                                   "total_req_rows", "free_req_rows")},
            "num_running": len(self.running),
            "num_waiting": self.num_queued(),
            "num_preemptions": self.retractions,
            **{k: mem[k] for k in ("kv_usage", "prefix_cache_queries", "prefix_cache_hits")},
            **{k: v for k, v in mem.items() if k.startswith(("state_", "held_state_"))},     # a hybrid model's
            **{k: v for k, v in mem.items() if k.startswith("disk_")},                    # the disk tier's
            **self.spec.stats.as_stats(),
        }
