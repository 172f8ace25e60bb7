"""A picked batch: the requests of one step and the StepInput sent to the device."""
from __future__ import annotations

from dataclasses import dataclass

from ..device.step import StepInput
from ..request import Req


@dataclass
class Batch:
    step_id: int
    reqs: list[Req]
    is_prefill: bool
    step: StepInput
    needs_previous: bool = False      # overlap: process batch k-1 before launching this one

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens
