"""Every process tandem spawns (engine, device process, tp ranks) dies with the process that spawned it.

PR_SET_PDEATHSIG asks the kernel for a SIGKILL when the parent dies, but only from the moment it is set: a
parent that dies between the spawn and that call (the child still importing torch, a second or two) never
sends it, and the child lives on as an orphan holding its shared memory (seen: an engine process left running
after its frontend was killed during start-up). So the spawner names itself in the child's environment and
the child, once the signal is armed, exits at once if its parent is no longer that process.
"""
from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "TANDEM_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that will call die_with_parent(): env (default os.environ) + this pid."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """Arm SIGKILL on the parent's death; exit now if the parent already died (then we were reparented)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and parent.isdigit() and os.getppid() != int(parent):
        os._exit(1)
