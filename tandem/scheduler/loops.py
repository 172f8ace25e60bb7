"""The two scheduler loops, side by side. They call the same pick_batch, launch_step and process_results
and differ only in *when* results are processed.

serial:  pick batch k, launch it, wait, process its results, then pick k+1 (the device idles meanwhile).
overlap: pick batch k, launch it and queue its result handle, then process batch k-1 while the device runs
         batch k. Host state lags one step: batch k is picked before k-1's tokens are known, so its decode
         input ids come from the FutureMap on the device, and a request that finished in k-1 may ride in k
         (its token is dropped in process_results).

The grammar branch (structured output, scheduler/grammar.py) changes only *when a step's token masks are
sent*: the mask of a row depends on the token its previous step sampled. Rule: a batch's masks are computed
once every step launched before it has been processed. In the serial loop that is always at launch. In the
overlap loop batch k+1 is launched at once (its forward runs while the host works) and its masks follow
right after batch k is processed (results.process_oldest); the device waits for them only before
sampling. An executor that samples within its launch (the inline one) processes batch k first instead.

The speculative branch (scheduler/speculative.py) changes *what a pick assumes*: batch k+1 is picked while
batch k still verifies drafts, assuming each of its runs is accepted whole with the n-gram's continuation as
bonus token, so positions, seeds, KV slots and the next drafts follow the assumed text and the head rows read
the FutureMap as plain decode rows do. Rule: processing batch k checks the assumption; where it failed, that
request's rows in every later in-flight batch are dropped (like a finished request riding in a step), it is
picked again from host truth, and their KV slots are freed only once the last in-flight batch that may touch
them was waited for. Penalized and draft-model requests, and those whose runs seldom hold (a failed pick costs
a step, a wait only the host's share of one), are not picked on an assumption: a drafting step of theirs is
processed before the next pick, so it runs serially, like a grammar row's mask in the inline executor.

The urgent-step branch (scheduler/urgent.py, the priority policy) changes *what a wait for a long step does*:
a prefill step is launched as one that yields, and while the loop waits for it (wait_long_step, the one call
each loop makes where it waits for steps to end: finish_steps), an arrival that outranks every prefill chunk in
flight is picked into an urgent step that the device runs between two of the long step's layers and whose
results are processed at once, before the long step's. Rules: an urgent step shares no request, row or KV slot
with a step in flight (its pick's Fence), and a request released while riding in a yielding step keeps its row
and KV until that step is processed (UrgentSteps.defer).

Where a pick or a launch needs host truth, it processes the steps in flight first (process_pending), named
here so that every wait is visible from the loops: a drafting step whose request may not be picked on an
assumption (pick_batch: must_sync), decode out of KV slots (pick_decode: retraction), preemption
(pick.preempt), drafts proposed from host truth (speculative.propose), grammar masks for an executor that samples
at launch (launch.launch_masks), and `needs_previous` (a prefill behind a prefill, an option).

The PP loop (pp_size P > 1, device/parallel/pp.py) is the overlap loop at depth P: up to P micro-batches in flight, one
per pipeline stage, so that every stage is busy. Its rule: a micro-batch is picked only from requests in no
in-flight micro-batch, but for a started prefill's next chunk (the chunked pipeline: it samples nothing, and
stages run micro-batches in launch order), and it takes at most 1/P of the decoding requests (pick.py). So a
request waits for its micro-batch k to be processed before it decodes again, which gives the invariants:
  - a request is in at most one in-flight micro-batch that samples for it (its last prefill chunk or a decode
    row; host state of a request never lags: no token dropped);
  - the tokens sampled for micro-batch k reach the first stage's FutureMap before any micro-batch that needs
    them launches: the last stage samples, the host waits for k, and the executor relays k's ids with the next
    launch (ProcessExecutor.launch_step), stashed before that step's gather;
  - memory is freed only when no in-flight micro-batch can still read it (Scheduler.finish states why).
The serial loop also serves pp_size > 1 (each step processed before the next launch); with pp_size 1 the
serial and overlap loops run as they always did.
"""
from __future__ import annotations

from typing import Callable

from .launch import launch_step
from .pick import pick_batch, pick_urgent
from .results import process_oldest, process_pending, process_results
from .scheduler import Scheduler
from .urgent import URGENT_POLL_S


def event_loop_serial(s: Scheduler, idle: Callable[[], bool]) -> None:
    rec = s.recorder
    while True:
        mark = rec.appended
        with rec.span("recv"):
            s.recv_requests()
        with rec.span("pick"):
            batch = pick_batch(s)
        if batch is not None:
            with rec.span("launch", batch.step_id):
                s.result_queue.append((batch, launch_step(s, batch)))
            finish_steps(s)                           # wait, process its results
        else:
            rec.drop_since(mark)
            s.memory.flush_disk_saves(s.executor)     # nothing in flight: the disk tier's queued saves go now
            if not idle():
                return


def event_loop_overlap(s: Scheduler, idle: Callable[[], bool]) -> None:
    rec, queue = s.recorder, s.result_queue
    while True:
        mark = rec.appended
        if queue and s.policy.ranks_steps and queue[-1][0].is_prefill:
            # The priority policy's rule: a prefill step in flight is long, and the next step picked before it
            # ends would run before anything that arrives meanwhile; wait for it, then pick (only the host's
            # share of a long step is not overlapped).
            finish_steps(s)
        with rec.span("recv"):
            s.recv_requests()
        with rec.span("pick"):
            batch = pick_batch(s)                     # host state lags one step (drafts: assumed accepted)
        if batch is not None and batch.needs_previous:
            process_pending(s)
        if batch is not None:
            with rec.span("launch", batch.step_id):
                queue.append((batch, launch_step(s, batch)))
        # At most one result pending: process batch k-1 while the device runs batch k, or flush it at once
        # when nothing was scheduled (no result waits for new traffic).
        if len(queue) > 1 or (batch is None and queue):
            process_oldest(s)
        elif batch is None:
            rec.drop_since(mark)
            s.memory.flush_disk_saves(s.executor)     # nothing in flight: the disk tier's queued saves go now
            if not idle():
                return


def event_loop_pp(s: Scheduler, idle: Callable[[], bool]) -> None:
    rec, queue, depth = s.recorder, s.result_queue, s.config.pp_size
    while True:
        mark = rec.appended
        with rec.span("recv"):
            s.recv_requests()
        batch = None
        if len(queue) < depth:
            with rec.span("pick"):
                batch = pick_batch(s)                 # only requests in no in-flight micro-batch
        if batch is not None and batch.needs_previous:
            process_pending(s)
        if batch is not None:
            with rec.span("launch", batch.step_id):
                queue.append((batch, launch_step(s, batch)))
        # Up to `depth` micro-batches in flight: process the oldest once the pipeline is full, or when nothing
        # more could be picked (its requests wait for it; no result waits for new traffic).
        if len(queue) >= depth or (batch is None and queue):
            process_oldest(s)
        elif batch is None:
            rec.drop_since(mark)
            if not idle():
                return


def finish_steps(s: Scheduler) -> None:
    """Process every step in flight. While the newest yields, urgent steps run in it first (wait_long_step)."""
    if s.result_queue and s.result_queue[-1][0].yields:
        wait_long_step(s)
    process_pending(s)


def wait_long_step(s: Scheduler) -> None:
    """The urgent-step branch's wait (urgent.py): until the last yielding step in flight is done, take arrivals
    in, launch an urgent step for those that outrank every prefill chunk in flight, and process each urgent step
    as soon as it is done, out of order (its requests are in no other step). A pick is tried only when something
    that could allow one changed (an arrival, an urgent step processed or launched): the device's threads share
    the cores with this loop."""
    rec, queue = s.recorder, s.result_queue
    long_handle = next(h for b, h in reversed(queue) if b.yields)
    looked = None                                # s.arrivals when a pick last found nothing
    while not long_handle.ready():
        done = next((i for i, (b, h) in enumerate(queue) if b.urgent and h.ready()), None)
        if done is not None:
            batch, handle = queue[done]
            del queue[done]
            with rec.span("process", batch.step_id):
                process_results(s, batch, handle)
            looked = None
            continue
        with rec.span("recv"):
            s.recv_requests()
        if looked != s.arrivals:
            with rec.span("pick"):
                batch = pick_urgent(s)
            looked = s.arrivals if batch is None else None
            if batch is not None:
                with rec.span("launch", batch.step_id):
                    queue.append((batch, launch_step(s, batch)))
                continue
        s.executor.poll_done(URGENT_POLL_S)


LOOPS = {"serial": event_loop_serial, "overlap": event_loop_overlap, "pp": event_loop_pp}
