"""A picked batch: the requests of one step and the StepInput sent to the device; a prefill chunk of one row."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..device.step import StepInput
from ..request import Req


@dataclass
class Batch:
    """Rows: `num_decode` decode rows first, then prefill chunks (a mixed step carries both). A speculating
    request appears once per row of its run (its own row, then its draft rows)."""
    step_id: int
    reqs: list[Req]
    is_prefill: bool                  # carries prefill tokens (alone, or mixed with decode rows)
    step: StepInput
    samples: list[bool]               # per row: its token is kept (False: a non-final prefill chunk)
    num_decode: int = 0
    needs_previous: bool = False      # overlap: process batch k-1 before launching this one
    masks_pending: bool = False       # the grammar branch: its token masks follow the launch (grammar.py)
    # The speculative branch under the overlap loop (scheduler/speculative.py): requests whose rows here were
    # picked on an assumption that failed (their results are dropped), and KV slots freed once this step has
    # been waited for (the last in-flight step that may touch them).
    dropped: set = field(default_factory=set)
    release: list = field(default_factory=list)
    # The urgent-step branch (scheduler/urgent.py): a long step the device may run urgent steps in (yields), and
    # such a step (urgent).
    yields: bool = False
    urgent: bool = False

    @property
    def speculative(self) -> bool:
        """Carries draft rows (scheduler/speculative.py)."""
        return bool((self.step.draft_lens > 0).any())

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens


@dataclass
class Chunk:
    """One prefill row: positions [start, start + n) of the request's fill ids."""
    req: Req
    start: int
    n: int
    last: bool            # ends the fill: only this chunk samples


@dataclass(frozen=True)
class Fence:
    """What the steps in flight hold, which a pick made while they run (an urgent step, scheduler/urgent.py) must
    leave alone: their requests, and the KV slots they write (cache_prefill shares a chunk's KV in the prefix cache
    when it is picked, so a hit on one of these slots would read it half written). An ordinary pick's fence is
    empty (NO_FENCE): it brings host truth up to date where it needs it instead."""
    reqs: frozenset[int] = frozenset()        # id() of each request
    slots: frozenset[int] = frozenset()

    def __contains__(self, req: Req) -> bool:
        return id(req) in self.reqs

    def __bool__(self) -> bool:
        """Steps in flight go on past this pick."""
        return bool(self.reqs)

    def writes(self, slots: list[int]) -> bool:
        """Does a step in flight write one of `slots`?"""
        return not self.slots.isdisjoint(slots)


NO_FENCE = Fence()
