"""The urgent-step branch of the priority policy: an arrival that outranks every prefill chunk of the long step in
flight is prefilled between two of that step's layers, not after the step.

Why: a step cannot be cut short, and a prefill step of a flood's 256-token chunk beside its decode rows runs
~240 ms on 2 CPU cores; a high-priority arrival that landed at its start waited for all of it
(benchmarks/results/policy_mixed.md). So a prefill step is launched as one that yields (batch.yields, b"Y"), and
the loops wait for it in loops.wait_long_step: arrivals are taken in as they come, and an urgent step is picked
for those that outrank every chunk in flight (pick.pick_urgent) and launched (b"U"). The device process runs it
before the long step's next layer (process/main.py: _StepLoop.between) and reports it first; its results are
processed at once, out of order (first tokens streamed), while the long step goes on.

UrgentSteps is this branch's manager, given to the Scheduler as Grammars and Speculation are: which steps yield,
the fence an urgent pick keeps to, whether a buffer slot is free for one, and the releases deferred to a yielding
step. It imports nothing of the scheduler's: the loops and the pick call it.

Invariants, each kept where it is named:
- An urgent step shares no request with a step in flight (its pick's Fence: no started prefill in flight,
  no retracted request whose rows are, PrefillAdder), and it carries prefill chunks only, so no row of it reads a
  FutureMap entry a step in flight has yet to write.
- No request-table row or KV slot it is given is one a step in flight may still write: a request released while
  it rides in a yielding step (finished, or retracted for the urgent one: pick.preempt) keeps them until that
  step has been processed (UrgentSteps.defer, called by Scheduler._release), and the table has spare rows
  meanwhile (EngineConfig.spare_rows).
- None of its prefix hits reads KV a step in flight writes (the Fence's slots, PrefillAdder.hit_in_flight:
  cache_prefill shares a chunk's KV when the chunk is picked, before it is written).
- Step k writes buffer slot k % buffer_slots: an urgent step is picked only where its slot is free (with 3 slots,
  two urgent steps may be in flight; the device runs the second after the first, at the long step's next layer).
- What the long step computes does not change: the urgent step writes only its own rows, slots and FutureMap
  entries, and gathers into buffers of its own (ModelRunner.nested). Processing it first changes no host state
  the long step's processing reads, but for requests it retracted, whose rows there are dropped (batch.dropped).
"""
from __future__ import annotations

from typing import Iterable

from ..device.executor import ResultHandle
from ..request import Req
from ..memory.disk_format import load_entries
from .batch import Batch, Fence

URGENT_POLL_S = 0.004    # a wait for a long step looks for arrivals this often (a socket poll each: ~0.5 % of a core)

InFlightSteps = Iterable[tuple[Batch, ResultHandle]]     # the result queue


class UrgentSteps:
    """The urgent-step branch's state and rules (the module docstring): off where the executor cannot run a step
    between two layers of another or the policy ranks no steps (EngineConfig.runs_urgent_steps)."""

    def __init__(self, on: bool = False) -> None:
        self.on = on
        self._deferred: dict[int, list[Req]] = {}     # step id -> the requests released while it was in flight

    def yields(self, batch: Batch) -> bool:
        """Is `batch` launched as a step that runs urgent ones between its layers? Any prefill step, but an
        urgent one, where the branch is on."""
        return self.on and batch.is_prefill and not batch.urgent

    # ---- the urgent pick's rules (pick.pick_urgent) -------------------------------------------------------
    def slot_free(self, steps: InFlightSteps, step_id: int, buffer_slots: int) -> bool:
        """Step `step_id` writes buffer slot step_id % buffer_slots: is no step in flight writing it?"""
        return all((step_id - b.step_id) % buffer_slots for b, _ in steps)

    def outranks_chunks(self, lead: Req, steps: InFlightSteps, outranks, t: float) -> bool:
        """Does `lead` outrank every prefill chunk in flight (what makes a step long)? The decode rows in flight
        are not asked: the long step carries the rows its lead does not outrank, often ones of the arrival's own
        rank (an earlier high-priority request's), and those wait the urgent step's time, as for any step of the
        arrival's."""
        return all(outranks(lead, r, t) for b, _ in steps if not b.urgent for r in b.reqs[b.num_decode:])

    def fence(self, steps: InFlightSteps) -> Fence:
        """What the steps in flight hold, which an urgent pick leaves alone."""
        steps = list(steps)
        return Fence(frozenset(id(r) for b, _ in steps for r in b.reqs),
                     frozenset(x for b, _ in steps for x in b.step.out_cache_loc.tolist() + loaded(b.step)))

    # ---- releases deferred to a yielding step ------------------------------------------------------------
    def defer(self, req: Req, steps: InFlightSteps) -> bool:
        """Keep a released request's row and KV until the yielding step it rides in has been processed (urgent
        steps may run before that step's last layers: Scheduler.finish); False where it rides in none."""
        for batch, _ in steps:
            if batch.yields and req in batch.reqs:
                self._deferred.setdefault(batch.step_id, []).append(req)
                return True
        return False

    def released(self, batch: Batch) -> list[Req]:
        """The requests deferred to `batch`, now processed: their rows and KV may go back."""
        return self._deferred.pop(batch.step_id, [])

    def deferred(self) -> list[Req]:
        """Every request whose release waits for a step in flight (Scheduler.audit_kv)."""
        return [r for reqs in self._deferred.values() for r in reqs]


def loaded(step) -> list[int]:
    """The KV slots a step's disk-tier loads write (both load lists; memory/disk_format.load_entries)."""
    return [x for ops in (step.kv_loads, step.kv_state_loads) for *_, slots in load_entries(ops)
            for x in slots.tolist()]
