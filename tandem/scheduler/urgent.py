"""The urgent-step branch of the priority policy: an arrival that outranks every prefill chunk of the long step in
flight is prefilled between two of that step's layers, not after the step.

Why: a step cannot be cut short, and a prefill step of a flood's 256-token chunk beside its decode rows runs
~240 ms on 2 CPU cores; a high-priority arrival that landed at its start waited for all of it
(benchmarks/results/policy_mixed.md). So a prefill step is launched as one that yields (batch.yields, b"Y"), and
the loops wait for it in wait_long_step: arrivals are taken in as they come, and an urgent step is picked for
those that outrank every chunk in flight (pick_urgent) and launched (b"U"). The device process runs it before the
long step's next layer (process/main.py: _StepLoop.between) and reports it first; its results are processed at
once, out of order (first tokens streamed), while the long step goes on.

Invariants, each kept where it is named:
- An urgent step shares no request with a step in flight (pick_prefill's `held`: no started prefill in flight,
  no retracted request whose rows are), and it carries prefill chunks only, so no row of it reads a FutureMap
  entry a step in flight has yet to write.
- No request-table row or KV slot it is given is one a step in flight may still write: a request released while
  it rides in a yielding step (finished, or retracted for the urgent one: pick.preempt) keeps them until that
  step has been processed (Scheduler._release), and the table has spare rows meanwhile (EngineConfig.spare_rows).
- None of its prefix hits reads KV a step in flight writes (pick_prefill's `held`: cache_prefill shares a
  chunk's KV when the chunk is picked, before it is written).
- Step k writes buffer slot k % buffer_slots: an urgent step is picked only where its slot is free (with 3 slots,
  two urgent steps may be in flight; the device runs the second after the first, at the long step's next layer).
- What the long step computes does not change: the urgent step writes only its own rows, slots and FutureMap
  entries, and gathers into buffers of its own (ModelRunner.nested). Processing it first changes no host state
  the long step's processing reads, but for requests it retracted, whose rows there are dropped (batch.dropped).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .batch import Batch, InFlight
from .pick import charge, pick_prefill, preempt
from .make_batch import make_batch
from .results import process_results

if TYPE_CHECKING:
    from .scheduler import Scheduler

URGENT_POLL_S = 0.004    # a wait for a long step looks for arrivals this often (a socket poll each: ~0.5 % of a core)


def yields(s: "Scheduler", batch: Batch) -> bool:
    """Is `batch` launched as a step that runs urgent ones between its layers? A prefill step under the priority
    policy, where the executor can (one CPU device process: EngineConfig.runs_urgent_steps)."""
    return (batch.is_prefill and s.policy.ranks_steps and s.config.urgent_steps and not batch.urgent
            and getattr(s.executor, "nests_steps", False))


def wait_long_step(s: "Scheduler") -> None:
    """Wait until the last yielding step in flight is done; meanwhile take arrivals in, launch an urgent step
    for those that outrank every prefill chunk in flight, and process each urgent step as soon as it is done.
    A pick is tried only when something that could allow one changed (an arrival, an urgent step processed or
    launched): the device's threads share the cores with this loop."""
    queue = s.result_queue
    long_handle = next(h for b, h in reversed(queue) if b.yields)
    looked = None                                # s.arrivals when a pick last found nothing
    while not long_handle.ready():
        done = next((e for e in queue if e[0].urgent and e[1].ready()), None)
        if done is not None:
            del queue[next(i for i, e in enumerate(queue) if e is done)]
            with s.recorder.span("process", done[0].step_id):
                process_results(s, *done)        # out of order: its requests are in no other step
            looked = None
            continue
        with s.recorder.span("recv"):
            s.recv_requests()
        if looked != s.arrivals:
            with s.recorder.span("pick"):
                batch = pick_urgent(s)
            looked = s.arrivals if batch is None else None
            if batch is not None:
                with s.recorder.span("launch", batch.step_id):
                    launch_urgent(s, batch)
                continue
        s.executor.poll_done(URGENT_POLL_S)


def pick_urgent(s: "Scheduler") -> Batch | None:
    """Prefill chunks of waiting requests led by one that outranks every prefill chunk in flight (the step rule
    of pick_batch: nothing the lead outranks rides along), retracting running requests the lead outranks where the
    running cap is full; None when there is no such lead, or when the next step's buffer slot is still held. The
    decode rows in flight are not asked: the long step carries the rows its lead does not outrank, often ones of
    the arrival's own rank (an earlier high-priority request's), and those wait the urgent step's time, as for
    any step of the arrival's."""
    queue = s.result_queue
    nxt = s.peek_step_id()
    if not s.waiting or any((nxt - b.step_id) % s.executor.buffer_slots == 0 for b, _ in queue):
        return None
    s.expire()                  # deadlines first, as pick_batch
    t = s.clock()
    s.policy.order(s.waiting, t)
    lead = next((r for r in s.waiting if s.grammars is None or s.grammars.ready(r)), None)
    riding = s.in_flight()
    chunks_of = [r for b, _ in queue if not b.urgent for r in b.reqs[b.num_decode:]]   # what makes a step long
    if lead is None or id(lead) in riding or not all(s.policy.outranks(lead, r, t) for r in chunks_of):
        return None
    held = InFlight(riding, {x for b, _ in queue for x in b.step.out_cache_loc.tolist()})
    preempt(s, held)
    chunks = pick_prefill(s, s.config.max_prefill_tokens, lead, held)
    if not chunks:
        return None
    batch = make_batch(s, chunks, [])
    charge(s, chunks, [])
    batch.urgent = True
    return batch


def launch_urgent(s: "Scheduler", batch: Batch) -> None:
    """Launch it with its token masks: its rows are new, so their grammars are current already."""
    masks = s.grammars.masks(batch, s.recorder) if len(batch.step.grammar_rows) else None
    s.recorder.launched(batch)
    s.result_queue.append((batch, s.executor.launch_step(batch.step, masks, urgent=True)))
