"""Building a picked batch's step: the rows' order, and the StepInput the device reads (ids, positions, KV slots,
sampling, penalties, logprobs, drafts), from the requests' host state.

Rows: decode rows first (one token each, input id from the FutureMap; a speculating request's run of rows), then
prefill chunks (host ids). Host state may lag one step (overlap loop): see pick.py's docstring.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..device.embed import flags as embed_flags
from ..device.step import StepInput
from ..request import Req
from ..sampler import draw_seeds
from .batch import Batch, Chunk
from .grammar import grammar_rows

if TYPE_CHECKING:
    from .scheduler import Scheduler


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


def make_batch(s: "Scheduler", chunks: list[Chunk], decode: list[Req],
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
    stale = {r for r in decode if r.spec.stale}
    for r in decode:
        # The tokens this step's rows sample, as a later pick may assume them (speculative.py): the drafts and
        # the n-gram's continuation after them, or nothing assumed (-1).
        r.spec.guess.extend(drafts[r] + [bonus.get(r, -1)] if r in drafts else [-1])
        r.spec.stale = False
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
            s.memory.restore_state(r)              # a hybrid's state from its checkpoint (none: nothing)
        r.filled = c.start + c.n
        if c.last:
            r.num_launched = len(r.output_ids) + 1
            r.spec.guess = [-1]
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
        embed=np.array([0] * len(decode) + [embed_flags(c.req.params, c.start, c.last) for c in chunks], np.int64),
        **_penalty_fields(decode, chunks, positions),
    )
    for c in chunks:
        s.memory.cache_prefill(c.req)      # after the step's rows are built: its own rows must not read it
    ops = s.memory.take_state_ops()      # a hybrid's state copies around this step's forward
    if ops is not None:
        step.state_ops = ops
    assert b == step.batch_size
    return Batch(step.step_id, reqs, bool(chunks), step, [j == 0 for _, j in rows_of] + [c.last for c in chunks],
                 num_decode=len(decode))
