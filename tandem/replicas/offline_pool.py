"""Data-parallel replicas for the offline API (`LLM(..., dp_size=D)`): the server's ReplicaSet (D engine
processes, the router, pinned core shares), driven from a private event-loop thread so that LLM.generate
stays a plain blocking call.

The loop thread spawns the engine processes; they die with it (PR_SET_PDEATHSIG follows the spawning thread),
and it lives until close().
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from ..config import EngineConfig
from ..device.streams import now
from ..request import StepOutput
from .engine_client import EngineError
from .replica_set import MEANS, DataParallel, ReplicaSet, replica_clients, replica_cores
from .router import Router

UNBOUNDED_WAITING = 1 << 30      # offline, every prompt is queued at once (the server's 503 bound does not apply)


class ReplicaPool:
    def __init__(self, config: EngineConfig, dp: DataParallel) -> None:
        replica_cores(config, dp)                    # a split the cores cannot take: ValueError before spawning
        config = config.replace(max_waiting_requests=UNBOUNDED_WAITING)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tandem-dp-loop", daemon=True)
        self.thread.start()
        self.replicas = ReplicaSet(replica_clients(config, dp), Router(dp.size, dp.router))
        try:
            self.info = self._call(self.replicas.start())
        except BaseException:
            self.close()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def run(self, requests: list[tuple[str, list[int], dict]], on_output: Callable[[StepOutput], None]) -> None:
        """Submit every (rid, prompt ids, sampling fields) and wait until all finish, handing each output to
        on_output (on the loop thread). ValueError, with everything aborted, if a replica refuses one."""
        async def submit_all():
            subs = await asyncio.gather(*(self.replicas.submit(rid, ids, params, now())
                                          for rid, ids, params in requests), return_exceptions=True)
            failed = [e for e in subs if isinstance(e, BaseException)]
            if failed:
                for rid, _, _ in requests:
                    self.replicas.abort(rid)
                e = failed[0]
                raise ValueError(e.message) if isinstance(e, EngineError) and e.status == 400 else e

            async def drain(st) -> None:
                async for o in self.replicas.outputs(st):
                    on_output(o)
            await asyncio.gather(*(drain(st) for st in subs))
        try:
            self._call(submit_all())
        except EngineError as e:                     # a replica died mid-run
            raise RuntimeError(f"a data-parallel replica failed: {e.message}") from None

    def stats(self) -> dict:
        """The replicas' engine stats, summed (kv_usage and device_idle_fraction: their mean)."""
        reps = [s for s, _, _ in self.replicas.replica_stats()]
        keys = {k for s in reps for k in s}
        return {k: sum(s.get(k, 0) for s in reps) / (len(reps) if k in MEANS else 1) for k in sorted(keys)}

    def close(self) -> None:
        if self.thread.is_alive():
            try:
                self._call(self.replicas.close())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join()
                self.loop.close()
