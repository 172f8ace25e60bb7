"""Process results: the only place sampled tokens become host truth, and the result queue's drain.

process_results waits on the step's copy_done, appends tokens, checks stops (stop.py: one stop check for both
loops), settles verified runs (Speculation), frees finished requests and emits outputs. process_oldest pops the
result queue; process_pending is the "process the previous result first" hook that pick and launch call when
they need host truth.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import faults
from ..device.executor import ResultHandle
from ..device.embed import OUT, normalized
from ..device.step import prompt_logprob_targets
from ..device.streams import now
from ..request import StepOutput
from ..device.verify import accepted_counts
from .batch import Batch
from .grammar import accept
from .stop import check_stop

if TYPE_CHECKING:
    from .scheduler import Scheduler


def process_oldest(s: "Scheduler") -> None:
    """Pop the oldest result handle from the result queue and process its batch; then the next batch is the
    oldest, its grammar rows are current and its pending token masks go out (grammar.py)."""
    batch, handle = s.result_queue.popleft()
    if s.grammars is not None:
        s.grammars.send_pending(batch, handle, s.recorder)
    with s.recorder.span("process", batch.step_id):
        process_results(s, batch, handle)
    if s.result_queue and s.grammars is not None:
        s.grammars.send_pending(*s.result_queue[0], s.recorder)


def process_pending(s: "Scheduler") -> None:
    """The "process the previous result first" hook: bring host state up to date with the device."""
    while s.result_queue:
        process_oldest(s)


def process_results(s: "Scheduler", batch: Batch, handle: ResultHandle) -> None:
    with s.recorder.span("wait", batch.step_id):
        tokens = handle.wait()                       # copy_done.wait()
    t = now()
    outputs: list[StepOutput] = []
    want = [r.params.logprobs for r in batch.reqs if r.params.logprobs is not None]
    lp = handle.logprobs(max(want)) if want else None     # (chosen [B], top ids [B, k], top logprobs [B, k])
    collect_prompt_logprobs(batch, handle)
    draft_lens = batch.step.draft_lens
    runs = _accepted_runs(batch, tokens) if batch.speculative else {}
    later = [b for b, _ in s.result_queue]          # the steps launched after this one, still in flight
    toks = tokens.tolist()
    vectors = _embeddings(batch, handle)
    for i, (req, tok, keep) in enumerate(zip(batch.reqs, toks, batch.samples)):
        if draft_lens[i] < 0:
            continue            # a draft row: its token belongs to its head row's run (below)
        if req.finished or req in batch.dropped:
            # One-step lag: the request finished in batch k-1 but rode in this batch, or it was picked on an
            # assumption about batch k-1's run that failed (speculative.py). Its tokens are dropped: never
            # appended, streamed or counted.
            continue
        req.kv_committed = req.filled
        if req.aborted:
            s.end(req, "error" if req.error is not None else "abort")   # error: its deadline (Scheduler.expire)
            continue
        if not keep:
            continue            # a non-final prefill chunk: its sampled token is discarded (see make_batch)
        if req.params.embed:
            outputs.append(_embedded(s, req, vectors[i]))      # prefill done: its vector, no token
            continue
        run, k = [tok], int(draft_lens[i])
        if k > 0:
            # A verified run (speculative.py): s_0..s_a are kept.
            accepted = runs[i]
            s.spec.settle(req, k, accepted)
            run = toks[i:i + accepted + 1]
        s.spec.follow(req, k, run, later, s.memory.free_slots)   # what later steps assumed; rejected drafts' KV
        kept: list[int] = []
        reason = None
        try:
            for tok in run:     # one token at a time: a stop inside the run truncates it where plain decode stops
                faults.check("process", req.prompt_ids)
                req.output_ids.append(tok)
                kept.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = t
                reason = check_stop(req, tok)
                if reason is None and req.grammar is not None and accept(req, tok):
                    reason = "stop"            # the grammar is complete (the JSON closed)
                if reason is not None:
                    break
        except Exception as e:                 # isolation: this request fails alone (Scheduler.fail)
            s.fail(req, e)
            continue
        if reason is not None:
            s.finish(req, reason)
        k = req.params.logprobs
        token_lp = None if k is None else _entries(lp, i, i + len(kept), k)
        prompt_lp, req.prompt_lp = req.prompt_lp, None      # sent once, with the first token
        outputs.append(StepOutput(req.rid, kept, reason is not None, reason, req.text if reason else None,
                                  len(req.prompt_ids), len(req.output_ids),
                                  num_cached_tokens=req.num_cached_tokens or 0, logprobs=token_lp,
                                  prompt_logprobs=prompt_lp,
                                  queue_time=req.queue_time if len(req.output_ids) == len(kept) else None))
    if s.config.speculative_config is not None and not batch.is_prefill:
        start, end = handle.device_span      # what a draft row and a draft model step cost is priced against this
        s.spec.observe_step(batch.step.draft_lens, end - start)
        s.spec.observe_decode(end - start)
    if batch.release:
        s.memory.free_slots(batch.release)      # this step, the last that could touch them, has been waited for
        batch.release = []
    for req in s.urgent.released(batch):        # released while this step could still write them (urgent.py)
        s.release_now(req)
    s.recorder.device(batch, handle.device_span, len(outputs), handle.comm_s, handle.stage_spans)
    s.emit(outputs)


def _embeddings(batch: Batch, handle: ResultHandle) -> dict[int, np.ndarray]:
    """Batch row -> raw pooled vector [H] of each embeddings row of the step (device/embed.py)."""
    rows = np.nonzero(batch.step.embed & OUT)[0]
    return dict(zip(rows.tolist(), handle.embeddings(len(rows)))) if len(rows) else {}


def _embedded(s: "Scheduler", req, vector: np.ndarray) -> StepOutput:
    """An embeddings request ends at its last prefill chunk: its vector, normalized, and no output token (its
    sampled one is dropped); its prompt's KV goes to the prefix cache as any finished request's."""
    s.finish(req, "stop")
    return StepOutput(req.rid, [], True, "stop", None, len(req.prompt_ids), 0,
                      num_cached_tokens=req.num_cached_tokens or 0, embedding=normalized(vector))


def _accepted_runs(batch: Batch, tokens: np.ndarray) -> dict[int, int]:
    """Head row -> accepted drafts of each verified run (verify.py's rule, as the device applied it)."""
    heads, acc = accepted_counts(batch.step.draft_lens, torch.from_numpy(tokens),
                                 torch.from_numpy(batch.step.input_ids))
    return dict(zip(heads.tolist(), acc.tolist()))


def _entries(lp: tuple, lo: int, hi: int, k: int) -> list:
    """[logprob, [[top id, top logprob], ...]] of entries lo..hi-1 of (chosen, top ids, top logprobs), as
    Python numbers (tolist per array: an 8,000-position prompt with k = 20 is 168k numbers)."""
    chosen, ids, top = lp[0][lo:hi].tolist(), lp[1][lo:hi, :k].tolist(), lp[2][lo:hi, :k].tolist()
    return [[c, [[a, b] for a, b in zip(i, t)]] for c, i, t in zip(chosen, ids, top)]


def collect_prompt_logprobs(batch: Batch, handle: ResultHandle) -> None:
    """Append each asking row's prompt logprobs of this step to its request (read in the order the device
    wrote them: prompt_logprob_targets)."""
    step = batch.step
    if not (step.prompt_logprobs >= 0).any():
        return
    targets = prompt_logprob_targets(step)
    if targets is None:
        return
    k = int(step.prompt_logprobs.max())
    lp = handle.prompt_logprobs(len(targets[0]), k)
    o = 0
    for i in np.nonzero((step.prompt_logprobs >= 0) & (step.use_future == 0))[0]:
        n = int(step.extend_lens[i]) - (0 if step.next_ids[i] >= 0 else 1)
        req, kr = batch.reqs[i], int(step.prompt_logprobs[i])
        if req.prompt_lp is None:
            req.prompt_lp = []
        req.prompt_lp.extend(_entries(lp, o, o + n, kr))
        o += n
