"""Pick batch: admission (prefill first, within a token budget and the KV memory), decode of all running
requests otherwise, and retraction when decode runs out of KV slots.

Host state may lag the device by one step (overlap loop): lengths here are `allocated`, which counts the
in-flight step's KV slot, and `num_launched`, which counts its token.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..device.step import StepInput
from ..request import Req, ReqStatus
from ..sampler import draw_seeds
from .batch import Batch

if TYPE_CHECKING:
    from .scheduler import Scheduler

NEW_TOKEN_CLIP = 256        # cap on a request's future tokens counted when reserving KV for admission


def pick_batch(s: "Scheduler") -> Batch | None:
    s.finish_idle_aborts()
    batch = pick_prefill(s)
    if batch is not None:
        # Optional hook: a prefill right behind a prefill waits for k-1 first (better TTFT, less overlap).
        batch.needs_previous = s.config.process_prev_before_prefill and any(
            b.is_prefill for b, _ in s.result_queue)
        return batch
    return pick_decode(s)


def _decode_reserve(s: "Scheduler", reqs: list[Req]) -> int:
    """KV the running requests are expected to still need (scaled by new_token_ratio, as in SGLang)."""
    left = sum(min(r.max_new_tokens() - r.num_launched, NEW_TOKEN_CLIP) for r in reqs)
    return int(left * s.new_token_ratio)


def pick_prefill(s: "Scheduler") -> Batch | None:
    while s.waiting and len(s.waiting[0].fill_ids()) + 1 > s.kv.num_slots:
        # Retracted after growing to the whole cache: it can never be resumed.
        s.end(s.waiting.popleft(), "length")
    if not s.waiting:
        return None
    budget = s.config.max_prefill_tokens
    decode_reserve = _decode_reserve(s, s.running)
    picked: list[Req] = []
    tokens = reserved = 0
    for req in s.waiting:
        if len(s.running) + len(picked) >= s.config.max_running_requests:
            break
        fill = req.fill_ids()
        cached = s.match_prefix(req)              # locks the hit, so it no longer counts as evictable
        n = len(fill) - cached                    # tokens this prefill computes
        if picked and tokens + n > budget:
            s.unmatch(req)
            break
        future = int(min(req.max_new_tokens() - len(req.output_ids), NEW_TOKEN_CLIP) * s.new_token_ratio)
        avail = s.available()                     # net of the slots already given to `picked`
        if not s.running and not picked:
            fits = n + 1 <= avail      # alone it needs its prompt and one token; retraction handles the rest
        else:
            fits = n + reserved + future <= avail - decode_reserve
        if not fits:
            s.unmatch(req)
            break
        req.slots = req.slots + s.alloc_slots(n)
        picked.append(req)
        tokens += n
        reserved += future
        s.prefix_queries += len(fill)
        s.prefix_hits += cached
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
    if not picked:
        return None
    for _ in picked:
        s.waiting.popleft()
    ids, locs = [], []
    for req in picked:
        req.row = s.rows.alloc()
        req.status = ReqStatus.RUNNING
        s.running.append(req)
        ids.extend(req.fill_ids()[req.cached_len:])
        locs.extend(req.slots[req.cached_len:])
    lens = np.array([r.allocated for r in picked], dtype=np.int64)
    ext = np.array([r.allocated - r.cached_len for r in picked], dtype=np.int64)
    return _make_batch(s, picked, True, extend=ext, seq=lens, ids=ids, locs=locs)


def pick_decode(s: "Scheduler") -> Batch | None:
    reqs = _decode_candidates(s)
    if not reqs:
        return None
    if s.available() < len(reqs):
        # Retraction needs host truth (the tokens of batch k-1): process the pending result first.
        s.process_pending()
        reqs = _retract(s, _decode_candidates(s))
        if not reqs:
            return None
    locs = []
    for req in reqs:
        req.slots.extend(s.alloc_slots(1))
        locs.append(req.slots[-1])
    b = len(reqs)
    seq = np.array([r.allocated for r in reqs], dtype=np.int64)
    return _make_batch(s, reqs, False, extend=np.ones(b, np.int64), seq=seq, ids=[0] * b, locs=locs)


def _decode_candidates(s: "Scheduler") -> list[Req]:
    # A request whose launched tokens already reach its limit finishes when batch k-1 is processed.
    return [r for r in s.running if not r.aborted and r.num_launched < r.max_new_tokens()]


def _retract(s: "Scheduler", reqs: list[Req]) -> list[Req]:
    """Free the KV of the requests with the fewest outputs (latest first on ties) until decode fits."""
    order = sorted(reqs, key=lambda r: (len(r.output_ids), -r.arrival_time))
    retracted = 0
    while s.available() < len(reqs) and len(reqs) > 1:
        victim = order.pop(0)
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


def _make_batch(s: "Scheduler", reqs: list[Req], is_prefill: bool, extend: np.ndarray, seq: np.ndarray,
                ids: list[int], locs: list[int]) -> Batch:
    b = len(reqs)
    positions = np.array([r.num_launched if not is_prefill else len(r.output_ids) for r in reqs], np.int64)
    for r in reqs:
        r.num_launched = (len(r.output_ids) if is_prefill else r.num_launched) + 1
    p = [r.params for r in reqs]
    step = StepInput(
        step_id=s.next_step_id(),
        rows=np.array([r.row for r in reqs], np.int64),
        extend_lens=extend, seq_lens=seq,
        use_future=np.zeros(b, np.int64) if is_prefill else np.ones(b, np.int64),
        input_ids=np.array(ids, np.int64), out_cache_loc=np.array(locs, np.int64),
        temperature=np.array([x.temperature for x in p], np.float64),
        top_p=np.array([x.top_p for x in p], np.float64),
        top_k=np.array([x.top_k for x in p], np.int64),
        min_p=np.array([x.min_p for x in p], np.float64),
        draw_seed=draw_seeds(np.array([r.seed for r in reqs], np.int64), positions),
        poison_rows=s.take_freed_rows(),
        prefix_lens=np.array([r.cached_len if is_prefill else 0 for r in reqs], np.int64),
        prefix_slots=np.array([x for r in reqs if is_prefill for x in r.slots[:r.cached_len]], np.int64),
    )
    return Batch(step.step_id, reqs, is_prefill, step)
