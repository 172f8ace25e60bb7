"""The frontend's handle on the engine process: start it, send requests, route its outputs to each request.

One reader task receives every engine message and puts each StepOutput on its request's queue; a watcher
notices an engine that died, and from then on every pending and new request fails fast with a 503 (and
`on_dead` lets the server exit, so a supervisor restarts it). The engine sends something at least every
second while its loop turns (outputs, stats, heartbeats): `silent_for()` is how long it has not, which is
how /health tells a stuck engine or device from a busy one.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..device.streams import now
from ..request import StepOutput
from .. import runtime_files
from ..lifeline import child_env
from . import ipc

log = logging.getLogger("tandem.server")
WATCH_S = 0.2            # how often the watcher looks at the engine process
STOP_TIMEOUT_S = 5.0     # Shutdown -> exit; then it is killed


class EngineError(Exception):
    """A request the engine refused (400, 503) or could not finish (engine down: 503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(eq=False)
class RequestStream:
    rid: str
    arrival: float
    accepted: asyncio.Future
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # StepOutput | EngineError
    first_token: float | None = None
    last_token: float | None = None
    aborted: bool = False     # nobody reads it any more; kept until the engine says it finished (metrics)
    num_cached_tokens: int = 0    # prompt tokens the prefix cache served (usage.prompt_tokens_details)
    num_prompt: int = 0           # prompt tokens (the router's outstanding-token count)
    max_new: int = 0              # tokens it may still generate at most, when submitted
    num_output: int = 0           # tokens generated so far
    priority: int = 0             # its class in the metrics (--scheduling-policy priority / fair)
    tenant: str = ""

    def outstanding(self) -> int:
        """Tokens the engine still has to compute for it: the prompt until its first token, then what is left
        of its output budget (the router's measure of load)."""
        return (self.num_prompt if self.num_output == 0 else 0) + \
            max(0, self.max_new - self.num_output)


class EngineClient:
    def __init__(self, config: EngineConfig, cpus: list[int] | None = None) -> None:
        self.config = config
        self.cpus = cpus                     # cores the engine (and its device process) may run on; None: all
        self.info: ipc.Ready | None = None
        self.reqs: dict[str, RequestStream] = {}
        self.stats: dict[str, float] = {}
        self.dead: str | None = None         # why the engine is down, once it is
        self.engine_failed = False           # it went down on its own, not by our shutdown
        self.closing = False
        self.on_output: Callable[[RequestStream, StepOutput, float], None] | None = None   # metrics hook
        self.on_dead: Callable[[], None] | None = None     # called once when the engine dies (not at shutdown)
        self.last_heard = now()             # when the engine last sent anything
        self.watchdog_s: float | None = None   # --watchdog-timeout: silent this long with requests open, it is
        #                                        killed and failed like a dead engine (None: never)
        self.proc: subprocess.Popen | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle ----------------------------------------------------------------------------------------
    async def start(self) -> ipc.Ready:
        """Spawn the engine process and wait until its model is loaded; RuntimeError if it fails."""
        self._dir = runtime_files.make_dir("ipc", tempfile.gettempdir())
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx, self._actx = zmq.Context(), zmq.asyncio.Context()
        self._tx = self._ctx.socket(zmq.PUSH)
        self._tx.setsockopt(zmq.SNDHWM, 100_000)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.bind(in_addr)
        self._rx = self._actx.socket(zmq.PULL)
        self._rx.bind(out_addr)
        # Spawned from the main thread: PR_SET_PDEATHSIG in the child follows this thread's life.
        cpus = [",".join(map(str, self.cpus))] if self.cpus else []
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.replicas.engine_proc", in_addr, out_addr, *cpus],
                                     stdin=subprocess.PIPE, start_new_session=True, close_fds=True, env=child_env())
        self.proc.stdin.write(pickle.dumps(self.config))
        self.proc.stdin.close()
        while not await self._rx.poll(int(WATCH_S * 1000)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self.proc.returncode} while starting")
        msg = ipc.decode(await self._rx.recv())
        if isinstance(msg, ipc.Failed):
            raise RuntimeError(f"the engine failed to start: {msg.message}")
        self.info = msg
        self.last_heard = now()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        return msg

    def begin_shutdown(self) -> None:
        """Stop accepting; fail every in-flight request with a 503 (retry elsewhere or later, as OpenAI's
        clients do); the engine aborts them too."""
        if self.closing:
            return
        self.closing = True
        self._fail_all(EngineError(503, "the server is shutting down"))
        self._send(ipc.Shutdown())

    def silent_for(self) -> float:
        """Seconds since the engine last sent anything (0 once it is known dead: health says why instead)."""
        return 0.0 if self.dead is not None else now() - self.last_heard

    async def close(self) -> None:
        """Stop the engine process and remove every folder it and this client made, at any point of start()."""
        self.begin_shutdown()
        for t in self._tasks:
            t.cancel()
        if self.proc is not None and self.info is None and self.proc.poll() is None:
            self.proc.terminate()            # still loading: it reads no Shutdown until its loop turns
        if self.proc is not None:
            deadline = now() + STOP_TIMEOUT_S
            while self.proc.poll() is None and now() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                log.warning("engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_tx"):
            self._tx.close(0)
            self._rx.close(0)
            self._ctx.term()
            self._actx.term()
            shutil.rmtree(self._dir, ignore_errors=True)
        if self.proc is not None:
            runtime_files.remove_owned_by(self.proc.pid)    # the engine's, should it have been killed

    # ---- requests ------------------------------------------------------------------------------------------
    async def submit(self, rid: str, prompt_ids: list[int], params: dict, arrival: float) -> RequestStream:
        """Queue a request; return once the engine accepted it (EngineError with 400/503 if not)."""
        if self.dead is not None:
            raise EngineError(503, f"the engine is not running: {self.dead}")
        if self.closing:
            raise EngineError(503, "the server is shutting down")
        st = RequestStream(rid, arrival, asyncio.get_running_loop().create_future(), num_prompt=len(prompt_ids),
                           priority=params.get("priority") or 0, tenant=params.get("user") or "")
        room = (self.info.max_context if self.info is not None else 0) - len(prompt_ids)
        st.max_new = max(0, min(room, params.get("max_tokens") or room))
        self.reqs[rid] = st
        try:
            sent = self._send(ipc.AddRequest(rid, prompt_ids, params))
        except BaseException:            # e.g. a field msgpack cannot encode: nothing may stay registered
            self.reqs.pop(rid, None)
            raise
        if not sent:
            self.reqs.pop(rid, None)
            if self.dead is None and self.proc.poll() is not None:   # no peer on the socket: it just died
                self._fail(f"the engine process exited (code {self.proc.returncode})")
            if self.dead is not None:
                raise EngineError(503, f"the engine is not running: {self.dead}")
            raise EngineError(503, "the engine's request queue is full")
        try:
            await st.accepted
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        return st

    def outstanding(self) -> int:
        """Tokens still to compute for every open request (the router's load of this engine)."""
        return sum(st.outstanding() for st in self.reqs.values())

    @staticmethod
    async def outputs(st: RequestStream) -> AsyncIterator[StepOutput]:
        while True:
            item = await st.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    def abort(self, rid: str) -> None:
        """Abort a request that has not finished (no-op otherwise); the engine frees its KV and answers with a
        finished output (finish_reason "abort"), which drops it here."""
        st = self.reqs.get(rid)
        if st is not None and not st.aborted:
            st.aborted = True
            if not self._send(ipc.AbortRequest(rid)):
                del self.reqs[rid]

    def _send(self, msg) -> bool:
        if self.dead is not None or not hasattr(self, "_tx"):
            return False
        try:
            self._tx.send(ipc.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    # ---- engine messages -----------------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            msg = ipc.decode(await self._rx.recv())
            try:
                self._dispatch(msg, now())
            except Exception:             # a bug here must not leave every request hanging
                log.exception("failed to dispatch %s", type(msg).__name__)

    def _dispatch(self, msg, t: float) -> None:
        self.last_heard = t
        if isinstance(msg, ipc.Outputs):
            self.stats = msg.stats
            for o in msg.outputs:
                st = self.reqs.get(o.rid)
                if st is None:
                    continue                  # ended here already (shutdown)
                st.num_output = o.num_output_tokens
                if self.on_output is not None:
                    self.on_output(st, o, t)
                if not st.aborted:
                    st.queue.put_nowait(o)
                if o.finished:
                    del self.reqs[o.rid]
        elif isinstance(msg, ipc.Replies):
            for rid, status, message in msg.items:
                st = self.reqs.get(rid)
                if st is None or st.accepted.done():
                    continue
                if st.aborted:                # its client left before the answer
                    if status != ipc.ACCEPTED:
                        del self.reqs[rid]
                    continue
                if status == ipc.ACCEPTED:
                    st.accepted.set_result(None)
                else:
                    del self.reqs[rid]
                    st.accepted.set_exception(EngineError(status, message))
        elif isinstance(msg, ipc.Stats):
            self.stats = msg.stats
        elif isinstance(msg, ipc.Failed):
            self._fail(f"the engine failed: {msg.message}")

    async def _watch(self) -> None:
        while self.dead is None:
            await asyncio.sleep(WATCH_S)
            if self.proc.poll() is not None:
                self._fail(f"the engine process exited (code {self.proc.returncode})")
            elif self._hung():
                self.proc.kill()            # its device processes die with it (lifeline)
                self._fail(f"the engine made no progress for {self.watchdog_s:g} s with requests in flight "
                           f"(--watchdog-timeout): a step or a device hangs")

    def _hung(self) -> bool:
        """The watchdog: requests are open and the engine has sent nothing (no step completed, no heartbeat) for
        watchdog_s. An idle engine is never hung, whatever its device does (/health says so meanwhile)."""
        return (self.watchdog_s is not None and bool(self.reqs) and not self.closing
                and self.silent_for() > self.watchdog_s)

    def _fail(self, reason: str) -> None:
        first = self.dead is None
        if first:
            self.dead = reason
        self._fail_all(EngineError(503, reason))
        self.stats = {**self.stats, "num_running": 0, "num_waiting": 0}
        if first and not self.closing:
            self.engine_failed = True
            log.error("%s", reason)
            if self.proc is not None:
                runtime_files.remove_owned_by(self.proc.pid)   # a killed engine leaves its shared memory
            if self.on_dead is not None:
                self.on_dead()

    def _fail_all(self, err: EngineError) -> None:
        """End every request this frontend holds with err (its stream or its pending submit raises it)."""
        for st in self.reqs.values():
            if st.accepted.done():
                st.queue.put_nowait(err)
            elif not st.accepted.cancelled():
                st.accepted.set_exception(err)
        self.reqs.clear()
