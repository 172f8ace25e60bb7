"""Data parallelism: D engine replicas behind one frontend (`tandem serve --dp D`).

Each replica is a whole engine (its own engine process: scheduler, radix cache, device process) with its own
EngineConfig, so a replica could itself be tensor-parallel. ReplicaSet looks like one EngineClient to the
HTTP layer: submit() asks the Router for a replica, and everything else (outputs, abort, health, shutdown)
fans out to or gathers from the replicas.

Cores are split: with D replicas on C usable cores, replica i is pinned to cores [i*C/D, (i+1)*C/D), and its
device threads default to that share (device/ranks.default_device_threads reads the affinity).

A replica that dies fails its own open requests with 503 at once (never a hang); the router never sends to
a dead replica (a send that finds its engine gone marks it dead and the request goes to another) nor to
one that has been silent past the health timeout (a hung device): with none left, a new request gets 503 at
once. With --exit-on-engine-failure (the default) the server then drains and exits 1, as with one engine,
so that a supervisor restarts the whole set (lifecycle.py: the other replicas' requests get a grace period
first); with --no-exit-on-engine-failure the other replicas keep serving, and /health stays 200 until the
last replica is down.
"""
from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass
from typing import Callable

from ..config import EngineConfig
from ..request import StepOutput
from . import ipc
from .engine_client import EngineClient, EngineError, RequestStream
from .router import ROUTERS, ReplicaLoad, Router


MEANS = {"kv_usage", "device_idle_fraction"}      # fractions: the replicas' value is their mean, not their sum


# ---- data-parallel options (kept apart from EngineConfig: a replica is an engine with its own config) -------
@dataclass(frozen=True)
class DataParallel:
    size: int = 1                   # engine replicas behind the one HTTP server (--dp)
    router: str = "least-load"      # how a request picks its replica (--router)
    pin_cores: bool = True          # split the usable cores between replicas (--dp-pin-cores)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--dp must be >= 1, got {self.size}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")


def add_dp_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallelism")
    g.add_argument("--dp", "--dp-size", dest="dp_size", type=int, default=1,
                   help="engine replicas (each its own scheduler and device process) behind one server (default: 1)")
    g.add_argument("--router", choices=ROUTERS, default="least-load",
                   help="with --dp: least-load sends a request to the replica with the fewest outstanding tokens; "
                        "cache-aware to the one whose prefix cache holds the longest prefix of its prompt")
    g.add_argument("--dp-pin-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="with --dp: pin each replica to its share of the usable cores")


def dp_options(args: argparse.Namespace) -> DataParallel:
    return DataParallel(args.dp_size, args.router, args.dp_pin_cores)


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """n contiguous, near-equal shares of the cores (ValueError when there are fewer cores than shares)."""
    if len(cores) < n:
        raise ValueError(f"--dp {n} needs at least {n} cores to pin, this process may use {len(cores)} "
                         f"(or pass --no-dp-pin-cores)")
    return [cores[i * len(cores) // n:(i + 1) * len(cores) // n] for i in range(n)]


def replica_cores(config: EngineConfig, dp: DataParallel) -> list[list[int] | None]:
    """The cores of each replica (None: unpinned); ValueError when the split cannot work."""
    if dp.size > 1 and config.nnodes > 1:
        raise ValueError(f"--dp {dp.size} with --nnodes {config.nnodes} is not supported: replicas run on this "
                         "machine; tensor parallelism inside a replica (--tp) works on one node")
    if dp.size == 1 or not dp.pin_cores:
        return [None] * dp.size
    shares = split_cores(sorted(os.sched_getaffinity(0)), dp.size)
    if config.device_threads is not None and config.device_threads > min(len(s) for s in shares):
        raise ValueError(f"--device-threads {config.device_threads} exceeds a replica's share of the cores "
                         f"({min(len(s) for s in shares)} with --dp {dp.size}): each thread would fight another")
    return shares


def replica_clients(config: EngineConfig, dp: DataParallel) -> list[EngineClient]:
    """One EngineClient per replica, each pinned to its share of the cores (when asked and D > 1)."""
    return [EngineClient(config, cpus=cores) for cores in replica_cores(config, dp)]


class ReplicaSet:
    """The EngineClient interface over D replicas (D = 1: a thin pass-through)."""

    def __init__(self, clients: list[EngineClient], router: Router, stuck_after_s: float = float("inf"),
                 watchdog_s: float | None = None) -> None:
        self.clients, self.router = clients, router
        self.stuck_after_s = stuck_after_s  # a replica silent this long takes no new request (--health-timeout)
        self.info: ipc.Ready | None = None
        self.closing = False
        self.refusing: str | None = None    # why new requests get 503 while in-flight ones finish (a drain)
        self.on_output: Callable[[RequestStream, StepOutput, float], None] | None = None   # metrics hook
        self.on_dead: Callable[[], None] | None = None     # a replica died (not at shutdown)
        for i, c in enumerate(clients):
            c.on_output = self._output
            c.on_dead = lambda i=i: self._replica_died(i)
            c.watchdog_s = watchdog_s       # a replica hung this long with requests open fails (--watchdog-timeout)

    # ---- life cycle ----------------------------------------------------------------------------------------
    async def start(self) -> ipc.Ready:
        """Start every replica at once; RuntimeError (the others stopped) if one cannot start."""
        started = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        bad = [e for e in started if isinstance(e, BaseException)]
        if bad:                        # the caller's close() stops the replicas that did start
            raise bad[0] if len(self.clients) == 1 else RuntimeError(f"a replica failed to start: {bad[0]}")
        first = started[0]
        self.info = ipc.Ready(first.model_name, min(r.max_context for r in started), first.vocab_size, first.pid)
        return self.info

    def stop_accepting(self, reason: str) -> None:
        """New requests get 503 (reason); open ones go on (the drain after a replica died)."""
        self.refusing = reason

    def begin_shutdown(self) -> None:
        self.closing = True
        for c in self.clients:
            c.begin_shutdown()

    async def close(self) -> None:
        self.closing = True
        await asyncio.gather(*(c.close() for c in self.clients))

    @property
    def engine_failed(self) -> bool:
        return any(c.engine_failed for c in self.clients)

    @property
    def dead(self) -> str | None:
        """Why the service is down: only once every replica is (the others keep serving)."""
        reasons = [c.dead for c in self.clients]
        if all(r is not None for r in reasons):
            return reasons[0] if len(reasons) == 1 else "; ".join(f"replica {i}: {r}" for i, r in enumerate(reasons))
        return None

    # ---- requests ------------------------------------------------------------------------------------------
    def _takes_requests(self, c: EngineClient) -> bool:
        return c.dead is None and not c.closing and c.silent_for() <= self.stuck_after_s

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(self._takes_requests(c), c.outstanding()) for c in self.clients]

    def refusal(self) -> str | None:
        """Why a new request gets 503 now, or None; /health answers 503 with the same reason."""
        if self.closing:
            return "the server is shutting down"
        if self.refusing is not None:
            return self.refusing
        if any(self._takes_requests(c) for c in self.clients):
            return None
        if self.dead is not None:
            return f"the engine is down: {self.dead}"
        silent = min(c.silent_for() for c in self.clients if c.dead is None)
        return f"the engine has made no progress for {silent:.0f} s (--health-timeout {self.stuck_after_s:g})"

    async def submit(self, rid: str, prompt_ids: list[int], params: dict, arrival: float) -> RequestStream:
        """Queue a request on the replica the router picks; EngineError(503) at once when none can take it.
        A replica found dead by the send itself (its watcher had not seen it yet) is skipped: another one is
        picked, so a request never gets a dead replica's error while a live one could serve it."""
        while True:
            loads = self.loads()
            if self.closing or self.refusing is not None or not any(r.alive for r in loads):
                raise EngineError(503, self.refusal() or "no replica can take a request now")
            c = self.clients[0 if len(self.clients) == 1 else self.router.pick(prompt_ids, loads)]
            try:
                return await c.submit(rid, prompt_ids, params, arrival)
            except EngineError:
                if c.dead is None or len(self.clients) == 1:
                    raise                  # refused by a live engine (400, full queue), or the only one

    outputs = staticmethod(EngineClient.outputs)

    def abort(self, rid: str) -> None:
        for c in self.clients:
            if rid in c.reqs:
                c.abort(rid)
                return

    @property
    def reqs(self) -> dict[str, RequestStream]:
        return {rid: st for c in self.clients for rid, st in c.reqs.items()}

    # ---- stats (metrics) -----------------------------------------------------------------------------------
    def replica_stats(self) -> list[tuple[dict, int, bool]]:
        """(engine stats, open requests, alive) of each replica."""
        return [(c.stats, len(c.reqs), c.dead is None) for c in self.clients]

    # ---- replica events ------------------------------------------------------------------------------------
    def _output(self, st: RequestStream, o: StepOutput, t: float) -> None:
        if self.on_output is not None:
            self.on_output(st, o, t)

    def _replica_died(self, i: int) -> None:
        self.router.forget(i)
        if self.on_dead is not None:
            self.on_dead()


__all__ = ["DataParallel", "EngineError", "ReplicaSet", "Router", "add_dp_args", "dp_options", "replica_clients",
           "replica_cores", "split_cores"]
