"""The scheduler: all request state and memory bookkeeping of the engine (host side only).

The device side (weights, KV cache, request table, FutureMap) sits behind `executor`; the scheduler sends it
index arrays through launch_step and reads sampled ids back through result handles.
"""
from __future__ import annotations

import collections
import itertools
import logging
import traceback
from typing import Callable

import numpy as np

from .. import faults
from ..config import EngineConfig
from ..device.executor import Executor, ResultHandle
from ..memory.kv_allocator import KVSlotAllocator
from ..memory.radix_cache import RadixCache
from ..memory.req_table import ReqRowAllocator
from ..request import Req, ReqStatus, StepOutput
from ..trace.recorder import Recorder
from .batch import Batch
from . import grammar
from .grammar import Grammars
from .results import process_results
from .speculative import MAX_VERIFY_ROWS, ROW_COST

log = logging.getLogger("tandem.scheduler")

NEW_TOKEN_RATIO_INIT = 0.5
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002


class Scheduler:
    def __init__(self, config: EngineConfig, executor: Executor, sink: Callable[[list[StepOutput]], None],
                 recorder: Recorder | None = None, poll: Callable[[], None] | None = None,
                 grammar_compiler=None) -> None:
        self.config = config
        self.grammars = Grammars(grammar_compiler) if grammar_compiler is not None else None
        self.poll = poll                    # pulls new messages (e.g. from ZMQ) into the inbox
        self.executor = executor
        self.sink = sink
        self.recorder = recorder or Recorder(enabled=False)
        self.kv = KVSlotAllocator(executor.num_slots)
        self.cache = RadixCache() if config.prefix_cache else None
        self.prefix_queries = 0             # prompt tokens looked up in the prefix cache at admission
        self.prefix_hits = 0                # of those, tokens whose KV the cache held
        self.rows = ReqRowAllocator(config.max_running_requests)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.inbox: collections.deque = collections.deque()        # ("add", Req) | ("abort", rid); thread-safe
        self.result_queue: collections.deque[tuple[Batch, ResultHandle]] = collections.deque()
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._freed_rows: list[int] = []
        self._step_ids = itertools.count()
        self._live: dict[str, Req] = {}
        self.retractions = 0
        self.failures = 0                   # requests ended by an error in their own path (fail)
        # Speculative decoding (speculative.py): batch rows the device buffers hold for drafts and rows a
        # verify step may carry (both set by the engine), drafts verified, drafts accepted, and verified runs
        # by their accepted drafts.
        self.max_draft_rows = 0
        self.max_verify_rows = MAX_VERIFY_ROWS
        self.drafter = None                 # the draft model (speculative_config method "draft_model")
        self.decode_step_s: float | None = None     # EMA of a decode step's device time, while a drafter runs
        self.row_cost = ROW_COST            # one more decode row's cost over a one-row step (observe_step)
        self.plain_step_s: dict[int, float] = {}    # EMA of a draft-free decode step's device time by its rows
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_hist: dict[int, int] = {}
        # The overlap loop's assumption (speculative.py): drafting picks made while the request's previous step
        # was in flight, and requests whose in-flight rows were dropped because it failed.
        self.spec_ahead_drafts = 0
        self.spec_ahead_dropped = 0
        self.spec_syncs = 0             # picks that first waited for host truth (the speculative branch's syncs)

    # ---- requests in ---------------------------------------------------------------------------------------
    def recv_requests(self) -> None:
        if self.poll is not None:
            self.poll()
        while self.inbox:
            kind, item = self.inbox.popleft()
            if kind == "add":
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

    def in_flight(self) -> set[int]:
        """ids of the requests in a launched, unprocessed step (PP: at most one micro-batch each, pick.py)."""
        return {id(r) for b, _ in self.result_queue for r in b.reqs}

    def finish_idle_aborts(self) -> None:
        """Finish aborted running requests that no launched, unprocessed step holds."""
        in_flight = self.in_flight()
        for req in [r for r in self.running if r.aborted and id(r) not in in_flight]:
            self.end(req, "abort")

    # ---- launch and results --------------------------------------------------------------------------------
    def launch_step(self, batch: Batch) -> ResultHandle:
        if batch.num_decode:
            self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        masks = grammar.launch_masks(self, batch)
        self.recorder.launched(batch)
        return self.executor.launch_step(batch.step, masks)

    def process_oldest(self) -> None:
        """Pop the oldest result handle from the result queue and process its batch; then the next batch is
        the oldest, its grammar rows are current and its pending token masks go out (grammar.py)."""
        batch, handle = self.result_queue.popleft()
        grammar.send_pending_masks(self, batch, handle)
        with self.recorder.span("process", batch.step_id):
            process_results(self, batch, handle)
        if self.result_queue:
            grammar.send_pending_masks(self, *self.result_queue[0])

    def process_pending(self) -> None:
        """The "process the previous result first" hook: bring host state up to date with the device."""
        while self.result_queue:
            self.process_oldest()

    def emit(self, outputs: list[StepOutput]) -> None:
        if outputs:
            self.sink(outputs)

    # ---- memory --------------------------------------------------------------------------------------------
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
                              req.error, req.num_cached_tokens or 0)])

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
        req.spec_guess, req.spec_stale = [], False      # nothing in flight; its re-prefill writes the FutureMap
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        if self.drafter is not None:
            self.drafter.release(req)
        if req.slots:
            if self.cache is not None:
                self._cache_kv(req)
            else:
                self.kv.free(req.slots)
            req.slots = []
        req.filled = 0
        if req.row:
            self.rows.free(req.row)
            self._freed_rows.append(req.row)
            req.row = 0

    def _cache_kv(self, req: Req) -> None:
        """Hand a leaving request's KV to the prefix cache (finish, abort or retraction).

        Cached: positions [0, n), n = min(filled, len(fill_ids) - 1) (at least what the tree already holds
        for it), whose writing step has been launched and whose token the host knows; slots of prefill
        chunks never launched are freed. Never the last token: the last sampled one has no KV yet, and a
        request that finished in batch k-1 but rides in batch k writes its extra token's KV at slot
        slots[n]: that slot is freed, not cached (it also keeps the tree the same under both loops).
        Every reader of a cached slot is launched after this point, so after the step that wrote it.
        """
        fill = req.fill_ids()
        n = max(min(req.filled, len(fill) - 1), req.cached_len)
        held = self.cache.insert(fill[:n], req.slots[:n])
        # [0, cached_len): the tree's own slots; [cached_len, held): this request's copy of KV the tree got
        # meanwhile from another request (freed); [held, n): now the tree's; [n, allocated): freed.
        self.kv.free(req.slots[req.cached_len:max(held, req.cached_len)] + req.slots[n:])
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = None, 0

    def cache_prefill(self, req: Req) -> None:
        """Share a running request's prompt KV as soon as the step that writes it is picked, so requests
        admitted in later steps hit it (requests sharing a system prompt need not wait for a finish).

        Safe because the picked step is launched before any later step is picked: every reader of these
        slots is launched after their writer (not in the same step: a step gathers keys before it writes).
        The request's lock moves to the new leaf. Skipped when the tree has meanwhile got KV of its own for
        these tokens (a batch mate with the same prefix): the request keeps its copy, and the finish path
        frees it."""
        if self.cache is None or req.filled <= req.cached_len:
            return
        ids = req.fill_ids()[:req.filled]
        if len(self.cache.match_prefix(ids)[0]) != req.cached_len:
            return
        self.cache.insert(ids, req.slots[:req.filled])
        slots, node = self.cache.match_prefix(ids)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, len(slots)

    def match_prefix(self, req: Req) -> int:
        """Admission: point the request at the longest cached prefix of its fill ids and lock it there.
        The last token is always computed: its logits sample the next token. Returns the hit length."""
        req.cached_len = 0
        if self.cache is not None and req.params.prompt_logprobs is None:   # those need every prompt position
            fill = req.fill_ids()
            slots, node = self.cache.match_prefix(fill[:-1])
            self.cache.lock(node)
            req.slots, req.cached_len, req.cache_node = slots, len(slots), node
        req.filled = req.cached_len
        return req.cached_len

    def unmatch(self, req: Req) -> None:
        """Undo match_prefix for a request that was not admitted after all."""
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.slots, req.cached_len, req.cache_node, req.filled = [], 0, None, 0

    def alloc_slots(self, n: int) -> list[int]:
        """n free KV slots, evicting unlocked prefix-cache leaves (LRU) only when the free list runs short."""
        short = n - self.kv.available()
        if short > 0 and self.cache is not None:
            self.kv.free(self.cache.evict(short))
        return self.kv.alloc(n)

    def reset_prefix_cache(self) -> None:
        """Free every unlocked cached prefix (vLLM's reset_prefix_cache): a benchmark that repeats one workload
        measures each round's prefill cold, not the previous round's cache hits."""
        if self.cache is not None:
            self.kv.free(self.cache.evict(self.cache.evictable_size))

    def available(self) -> int:
        """KV slots a step may get: free, plus cached but unlocked (evictable on demand)."""
        return self.kv.available() + (self.cache.evictable_size if self.cache is not None else 0)

    def audit_kv(self) -> None:
        """Debug check: every KV slot is free, held by a live request, or owned by the tree, exactly once."""
        owned = list(self.kv._free)
        if self.cache is not None:
            owned += self.cache.all_slots()
        for req in self._live.values():
            owned += req.slots[req.cached_len:]
        for batch, _ in self.result_queue:
            owned += batch.release             # dropped speculative rows' slots, freed once that step is waited for
        assert sorted(owned) == list(range(self.kv.num_slots)), "KV slot ownership is not a partition"

    def take_freed_rows(self) -> np.ndarray:
        rows, self._freed_rows = self._freed_rows, []
        return np.array(rows if self.config.poison_future_map else [], dtype=np.int64)

    def next_step_id(self) -> int:
        return next(self._step_ids)

    # ---- state ---------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting or self.running or self.result_queue)

    def stats(self) -> dict:
        cached = self.cache.total_size if self.cache is not None else 0
        evictable = self.cache.evictable_size if self.cache is not None else 0
        return {
            "total_kv_slots": self.kv.num_slots,
            "free_kv_slots": self.kv.available(),
            "cached_kv_slots": cached,          # owned by the prefix cache (locked or not)
            "evictable_kv_slots": evictable,    # cached and unlocked: available to new steps
            "total_req_rows": self.rows.size,
            "free_req_rows": self.rows.available(),
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + sum(1 for k, _ in list(self.inbox) if k == "add"),
            "kv_usage": 1.0 - self.available() / self.kv.num_slots,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_ahead_drafts": self.spec_ahead_drafts,      # drafting picks made while its previous step ran
            "spec_ahead_dropped": self.spec_ahead_dropped,    # picks ahead whose assumption failed
            "spec_syncs": self.spec_syncs,      # picks that waited for an in-flight step's results (not assumable)
            # verified runs that accepted a drafts, one flat key per a (replicas' stats are summed key by key)
            **{f"spec_accepted_len_{a}": n for a, n in sorted(self.spec_accepted_hist.items())},
        }
