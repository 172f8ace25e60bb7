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

from typing import TYPE_CHECKING

import numpy as np

from dataclasses import dataclass

from ..device.step import StepInput
from ..request import Req, ReqStatus
from ..sampler import draw_seeds
from .batch import Batch
from . import speculative
from .grammar import grammar_rows

if TYPE_CHECKING:
    from .scheduler import Scheduler

NEW_TOKEN_CLIP = 256        # cap on a request's future tokens counted when reserving KV for admission
IN_BATCH_SHARE = 32         # uncached tokens a request shares with a batch mate that defer it one step


@dataclass
class Chunk:
    """One prefill row: positions [start, start + n) of the request's fill ids."""
    req: Req
    start: int
    n: int
    last: bool            # ends the fill: only this chunk samples


def pick_batch(s: "Scheduler") -> Batch | None:
    if speculative.must_sync(s):
        # A step picked after a speculative one assumes its runs are accepted whole (scheduler/speculative.py);
        # a request that may not be picked on that assumption needs its accepted count first.
        s.spec_syncs += 1
        s.process_pending()
    s.finish_idle_aborts()
    if s.grammars is not None:
        s.grammars.collect(s)
    decode = _decode_candidates(s)
    mixed = s.config.enable_mixed_chunk and bool(decode)
    budget = min(s.config.max_prefill_tokens, s.config.mixed_prefill_tokens) if mixed else \
        s.config.max_prefill_tokens
    chunks = pick_prefill(s, budget)
    if chunks:
        # Mixed step: the decode rows ride along if their slots are there; retraction needs host truth and
        # is left to the next decode-only step.
        decode = decode if mixed and s.available() >= len(decode) else []
        batch = _make_batch(s, chunks, _alloc_decode(s, decode))
        # Optional hook: a prefill right behind a prefill waits for k-1 first (better TTFT, less overlap).
        batch.needs_previous = s.config.process_prev_before_prefill and any(
            b.is_prefill for b, _ in s.result_queue)
        return batch
    return pick_decode(s)


def _decode_reserve(s: "Scheduler", reqs: list[Req]) -> int:
    """KV the running requests are expected to still need (scaled by new_token_ratio, as in SGLang)."""
    left = sum(min(r.max_new_tokens() - r.num_launched, NEW_TOKEN_CLIP) for r in reqs)
    return int(left * s.new_token_ratio)


def pick_prefill(s: "Scheduler", budget: int) -> list[Chunk]:
    """Prefill chunks of at most `budget` tokens in all: a started chunked prefill first, then admissions;
    but once a chunk, arrivals whose whole prefill fits go first, alone, for one step.

    A request is admitted whole (its prompt's KV is allocated at once, so a chunked prefill never stalls for
    memory) and prefilled in chunks: it keeps its row and KV across chunks and joins decode after its last.
    """
    while s.waiting and len(s.waiting[0].fill_ids()) + 1 > s.kv.num_slots:
        # Retracted after growing to the whole cache: it can never be resumed.
        s.end(s.waiting.popleft(), "length")
    chunks: list[Chunk] = []
    tokens = 0
    started = [r for r in s.running if r.prefilling and not r.aborted]    # in flight or not (module docstring)
    # Arrivals go first for one step, once per chunk of a started prefill: a short request behind a long prompt
    # waits for the chunk in flight, not also for the next chunk in the step that would carry it.
    aside = bool(s.waiting) and bool(started) and not any(r.stood_aside for r in started)
    if not aside:
        tokens = _continue_started(started, chunks, budget)
    decode_reserve = _decode_reserve(s, s.running)
    admitted: list[Req] = []
    reserved = 0
    for req in s.waiting:
        if tokens >= budget or len(s.running) + len(admitted) >= s.config.max_running_requests:
            break
        if s.grammars is not None and not s.grammars.ready(req):
            continue                              # its grammar still compiles: the requests behind it go on
        fill = req.fill_ids()
        cached = s.match_prefix(req)              # locks the hit, so it no longer counts as evictable
        n = len(fill) - cached                    # tokens this prefill computes
        mates = [c.req for c in chunks] + (started if aside else [])
        if s.cache is not None and any(_shared(fill, m.fill_ids()) - cached >= IN_BATCH_SHARE for m in mates):
            # A batch mate computes the same uncached prefix in this step: wait one step and hit its KV
            # (a burst of requests behind one system prompt computes it once, not once per step's admission).
            s.unmatch(req)
            break
        if aside and n > budget - tokens:
            # Standing aside is for arrivals whose whole prefill fits this step; a long one queues behind.
            s.unmatch(req)
            break
        future = int(min(req.max_new_tokens() - len(req.output_ids), NEW_TOKEN_CLIP) * s.new_token_ratio)
        avail = s.available()                     # net of the slots already given to `admitted`
        if not s.running and not admitted:
            fits = n + 1 <= avail      # alone it needs its prompt and one token; retraction handles the rest
        else:
            fits = n + reserved + future <= avail - decode_reserve
        if not fits:
            s.unmatch(req)
            break
        req.slots = req.slots + s.alloc_slots(n)
        admitted.append(req)
        reserved += future
        s.prefix_queries += len(fill)
        s.prefix_hits += cached
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        take = min(n, budget - tokens)
        chunks.append(Chunk(req, cached, take, take == n))
        tokens += take
    for req in admitted:
        s.waiting.remove(req)                     # a prefix of the queue, but for requests whose grammar compiles
        req.row = s.rows.alloc()
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


def _shared(a: list[int], b: list[int]) -> int:
    n, m = 0, min(len(a), len(b))
    while n < m and a[n] == b[n]:
        n += 1
    return n


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
    reqs, drafts, bonus = speculative.propose(s, reqs)       # drafts only where their KV slots are there
    if not reqs:
        return None
    return _make_batch(s, [], _alloc_decode(s, reqs, drafts), drafts, bonus)


def _alloc_decode(s: "Scheduler", reqs: list[Req], drafts: dict[Req, list[int]] | None = None) -> list[Req]:
    """One KV slot per decode row: a request's own token and each of its draft tokens."""
    for req in reqs:
        req.slots.extend(s.alloc_slots(1 + len(drafts.get(req, ())) if drafts else 1))
        req.filled = req.allocated
    return reqs


def _decode_candidates(s: "Scheduler") -> list[Req]:
    # A request whose launched tokens already reach its limit finishes when batch k-1 is processed; one
    # still prefilling joins decode after its last chunk.
    reqs = [r for r in s.running
            if not r.aborted and not r.prefilling and r.num_launched < r.max_new_tokens()]
    if s.config.pp_size == 1:
        return reqs
    busy = s.in_flight()                  # pipeline: at most one in-flight micro-batch per request
    share = -(-len(reqs) // s.config.pp_size)
    return [r for r in reqs if id(r) not in busy][:share]


def _prompt_lp(c: Chunk) -> int:
    """The prompt logprobs a chunk returns: those asked for, on the first fill only (a retracted request's
    re-prefill has them already)."""
    k = c.req.params.prompt_logprobs
    return -1 if k is None or c.req.output_ids else k


def _penalty_fields(decode: list[Req], chunks: list[Chunk], positions: list[int]) -> dict:
    """StepInput fields for penalties, logit_bias and min_tokens (tandem/device/penalties.py).

    A penalized row's first chunk resets its device state and sends its cached prefix ids (the chunks send
    their own ids anyway); a token counts as an output unless a non-final chunk sampled it. min_tokens:
    while the token this step samples is at an output position below it, EOS and the stop ids get -inf."""
    reqs = decode + [c.req for c in chunks]
    first = [False] * len(decode) + [c.start == c.req.cached_len for c in chunks]
    prefix_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    for i, (r, is_first, pos) in enumerate(zip(reqs, first, positions)):
        p = r.params
        if is_first and (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1):
            prefix_ids.extend(r.fill_ids()[:r.cached_len])
        if not p.logit_bias and pos >= p.min_tokens:
            continue                              # the common case: nothing to add to this row's logits
        bans = (set(r.eos_token_ids) | set(p.stop_token_ids)) if pos < p.min_tokens else set()
        for tok, val in ((p.logit_bias or {}) | dict.fromkeys(bans, -np.inf)).items():
            bias_rows.append(i)
            bias_ids.append(tok)
            bias_vals.append(val)
    params = [r.params for r in reqs]
    return dict(
        prompt_lens=np.array([len(r.prompt_ids) for r in reqs], np.int64),
        pen_reset=np.array(first, np.int64),
        pen_count=np.array([1] * len(decode) + [int(c.last) for c in chunks], np.int64),
        presence_penalty=np.array([p.presence_penalty for p in params], np.float64),
        frequency_penalty=np.array([p.frequency_penalty for p in params], np.float64),
        repetition_penalty=np.array([p.repetition_penalty for p in params], np.float64),
        pen_prefix_ids=np.array(prefix_ids, np.int64), bias_rows=np.array(bias_rows, np.int64),
        bias_ids=np.array(bias_ids, np.int64), bias_vals=np.array(bias_vals, np.float64))


def _retract(s: "Scheduler", reqs: list[Req]) -> list[Req]:
    """Free the KV of the requests with the fewest outputs (latest first on ties) until decode fits.
    Requests still prefilling hold KV too and are candidates (their launched chunks go to the cache)."""
    pool = reqs + [r for r in s.running if r.prefilling and not r.aborted]
    order = sorted(pool, key=lambda r: (len(r.output_ids), -r.arrival_time))
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


def _make_batch(s: "Scheduler", chunks: list[Chunk], decode: list[Req],
                drafts: dict[Req, list[int]] | None = None, bonus: dict[Req, int] | None = None) -> Batch:
    """Decode rows first, shortest first (one token each, input id from the FutureMap), then prefill chunks
    (host ids). A request with drafts (speculative.py) has k + 1 decode rows: its own, then one per draft
    (host id, the next position and seed position, the next of its KV slots; draft_lens marks them).

    A non-final chunk samples too (the device samples every row), but its token is discarded in
    process_results: it advances neither `num_launched` nor the seed position, and the value it stashes in
    the FutureMap is never read (the next chunk takes host ids; the last chunk overwrites it before any
    decode step gathers it).
    """
    drafts, bonus = drafts or {}, bonus or {}
    decode = sorted(decode, key=lambda r: r.allocated)    # shortest first: the device groups rows by length
    rows_of = [(r, j) for r in decode for j in range(1 + len(drafts.get(r, ())))]   # (request, row in its run)
    # A head row whose FutureMap row holds a dropped row's token takes its last token from the host.
    stale = {r for r in decode if r.spec_stale}
    for r in decode:
        # The tokens this step's rows sample, as a later pick may assume them (speculative.py): the drafts and
        # the n-gram's continuation after them, or nothing assumed (-1).
        r.spec_guess.extend(drafts[r] + [bonus.get(r, -1)] if r in drafts else [-1])
        r.spec_stale = False
    decode = [r for r, _ in rows_of]
    reqs = decode + [c.req for c in chunks]
    positions = [r.num_launched + j for r, j in rows_of] + [len(c.req.output_ids) for c in chunks]  # seed positions
    width = {r: 1 + len(drafts.get(r, ())) for r in drafts}
    ext = [1] * len(decode) + [c.n for c in chunks]
    seq = [r.allocated - width.get(r, 1) + 1 + j for r, j in rows_of] + [c.start + c.n for c in chunks]
    ids = [(r.output_ids[-1] if r in stale else 0) if j == 0 else drafts[r][j - 1] for r, j in rows_of]
    locs = [r.slots[r.allocated - width.get(r, 1) + j] for r, j in rows_of]
    use_future = [int(j == 0 and r not in stale) for r, j in rows_of]
    draft_lens = [(width.get(r, 1) - 1) if j == 0 else -1 for r, j in rows_of]
    prefix_lens, prefix_slots = [0] * len(decode), []
    for r, j in rows_of:
        r.num_launched += 1
    for c in chunks:
        r = c.req
        ids.extend(r.fill_ids()[c.start:c.start + c.n])
        locs.extend(r.slots[c.start:c.start + c.n])
        first = c.start == r.cached_len            # a row's first chunk maps its cached prefix on the device
        prefix_lens.append(r.cached_len if first else 0)
        if first:
            prefix_slots.extend(r.slots[:r.cached_len])
        r.filled = c.start + c.n
        if c.last:
            r.num_launched = len(r.output_ids) + 1
            r.spec_guess = [-1]
    b = len(reqs)
    samp = np.array([r.sampling_row for r in reqs], np.float64).reshape(b, 4)   # prepared when taken in
    step = StepInput(
        step_id=s.next_step_id(),
        rows=np.array([r.row for r in reqs], np.int64),
        extend_lens=np.array(ext, np.int64), seq_lens=np.array(seq, np.int64),
        use_future=np.array(use_future + [0] * len(chunks), np.int64),
        input_ids=np.array(ids, np.int64), out_cache_loc=np.array(locs, np.int64),
        temperature=samp[:, 0].copy(), top_p=samp[:, 1].copy(),
        top_k=np.array([r.sampling_row[2] for r in reqs], np.int64), min_p=samp[:, 3].copy(),
        draw_seed=draw_seeds(np.array([r.seed for r in reqs], np.int64), np.array(positions, np.int64)),
        poison_rows=s.take_freed_rows(),
        prefix_lens=np.array(prefix_lens, np.int64), prefix_slots=np.array(prefix_slots, np.int64),
        grammar_rows=grammar_rows(reqs),
        num_logprobs=np.array([-1 if r.params.logprobs is None else r.params.logprobs for r in reqs], np.int64),
        prompt_logprobs=np.array([-1] * len(decode) + [_prompt_lp(c) for c in chunks], np.int64),
        next_ids=np.array([-1] * len(decode) + [-1 if c.last else c.req.fill_ids()[c.start + c.n] for c in chunks],
                          np.int64),
        draft_lens=np.array(draft_lens + [0] * len(chunks), np.int64),
        **_penalty_fields(decode, chunks, positions),
    )
    for c in chunks:
        s.cache_prefill(c.req)      # after the step's rows are built: its own rows must not read it
    assert b == step.batch_size
    return Batch(step.step_id, reqs, bool(chunks), step, [j == 0 for _, j in rows_of] + [c.last for c in chunks],
                 num_decode=len(decode))
