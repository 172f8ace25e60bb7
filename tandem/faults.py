"""Fault injection, for the tests of engine isolation and the chaos run (never set in production).

TANDEM_INJECT_FAULT="STAGE:ID,ID,..." makes every request whose prompt starts with those token ids raise
InjectedFault at STAGE: "prepare" (when the scheduler takes the request in) or "process" (when the results of
its step are processed). A request sent as token ids hits it exactly; nothing else is affected.
"""
from __future__ import annotations

import os

ENV = "TANDEM_INJECT_FAULT"
STAGES = ("prepare", "process")


class InjectedFault(RuntimeError):
    """The error a fault-injected request raises."""


def _parse(spec: str | None) -> tuple[str, list[int]] | None:
    if not spec:
        return None
    stage, _, ids = spec.partition(":")
    if stage not in STAGES or not ids:
        raise ValueError(f"{ENV} must be 'STAGE:ID,ID,...' with STAGE in {STAGES}, got {spec!r}")
    return stage, [int(t) for t in ids.split(",")]


_FAULT = _parse(os.environ.get(ENV))


def check(stage: str, prompt_ids: list[int]) -> None:
    """Raise InjectedFault if the configured fault matches this stage and prompt."""
    if _FAULT is not None and _FAULT[0] == stage and prompt_ids[:len(_FAULT[1])] == _FAULT[1]:
        raise InjectedFault(f"fault injected at {stage} ({ENV})")


def set_fault(spec: str | None) -> None:
    """Set the fault of this process (tests); None clears it."""
    global _FAULT
    _FAULT = _parse(spec)
