"""A picked batch: the requests of one step and the StepInput sent to the device."""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def speculative(self) -> bool:
        """Carries draft rows (scheduler/speculative.py): no step is picked before it is processed."""
        return bool((self.step.draft_lens > 0).any())

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens
