"""Launch step: hand a picked batch to the executor and return its result handle at once.

The grammar branch decides here whether a batch's token masks go with the launch or follow it (grammar.py's
rule: masks are computed once every step launched before the batch has been processed); the urgent-step branch
(urgent.py) whether a step yields: the device may run urgent steps between its layers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..device.executor import ResultHandle
from .batch import Batch
from .results import process_pending
from .scheduler import NEW_TOKEN_RATIO_DECAY, NEW_TOKEN_RATIO_MIN

if TYPE_CHECKING:
    from .scheduler import Scheduler


def launch_step(s: "Scheduler", batch: Batch) -> ResultHandle:
    if batch.num_decode:
        s.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, s.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
    masks = launch_masks(s, batch)
    s.recorder.launched(batch)
    batch.yields = s.urgent.yields(batch)
    if not batch.urgent:
        # The disk tier's copies ride ordinary steps only: an urgent one runs inside the step in flight, before
        # that step has written the KV its saves would copy (memory/disk_tier.py)
        ops = s.memory.take_disk_ops()
        if ops is not None:
            step = batch.step
            step.kv_saves, step.kv_loads, step.kv_state_saves, step.kv_state_loads = ops
    if batch.yields or batch.urgent:          # only an executor that nests steps (UrgentSteps.on)
        return s.executor.launch_step(batch.step, masks, yields=batch.yields, urgent=batch.urgent)
    return s.executor.launch_step(batch.step, masks)


def launch_masks(s: "Scheduler", batch: Batch) -> np.ndarray | None:
    """The masks to send with the launch, or None when they follow it (batch.masks_pending)."""
    if not len(batch.step.grammar_rows):
        return None
    if batch.urgent:
        return s.grammars.masks(batch, s.recorder)     # its rows are new: their grammars are current already
    if s.result_queue and not s.executor.defers_masks:
        process_pending(s)                    # this executor samples at launch: host truth first
    if not s.result_queue:
        return s.grammars.masks(batch, s.recorder)
    batch.masks_pending = True
    return None
