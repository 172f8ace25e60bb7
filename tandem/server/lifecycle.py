"""When and how the server stops: signals at any moment, and the drain after an engine replica died.

Signals. SIGTERM / SIGINT handlers are installed before the first engine process or runtime folder exists
and stay until the last one is gone (uvicorn's own handlers, which live only while it serves, are not used),
so a signal during start-up, serving or teardown always takes the ordered path: stop accepting, end every
in-flight request with a 503 (an SSE error event + [DONE] for streams), stop the engines, remove their
folders, exit 0. During start-up a signal cancels the start. A second signal skips uvicorn's graceful wait.

Engine failure (with --exit-on-engine-failure, the default). A replica that dies has already failed its own
requests with 503 (replicas/engine_client.py). The server then:
  1. stops accepting: new requests get 503 + Retry-After, /health is 503, the listener stays open;
  2. lets the other replicas' in-flight requests finish, for at most `grace_s` (--engine-failure-grace);
  3. ends whatever is left with a 503 (error event + [DONE] for streams): never a cut connection;
  4. only then tells uvicorn to exit, which finds every response written; the exit code is 1.
Invariant: uvicorn's should_exit is set only after every open request was finished or failed, so its own
graceful-shutdown timeout never cancels a handler mid-response (that cancel is a plain-text 500 or a reset).
"""
from __future__ import annotations

import asyncio
import logging
import signal

from ..device.streams import now
from ..replicas.replica_set import ReplicaSet

log = logging.getLogger("tandem.server")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
DRAIN_POLL_S = 0.05


class Lifecycle:
    def __init__(self, client: ReplicaSet, exit_on_failure: bool, grace_s: float) -> None:
        self.client, self.exit_on_failure, self.grace_s = client, exit_on_failure, grace_s
        self.server = None                  # the uvicorn.Server, once it exists
        self.signalled = False
        self._starting: asyncio.Future | None = None
        self._drain: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- signals -------------------------------------------------------------------------------------------
    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal)

    def remove(self) -> None:
        if self._loop is not None:
            for sig in SIGNALS:
                self._loop.remove_signal_handler(sig)

    async def start(self, coro):
        """Await a start-up step; asyncio.CancelledError if a signal came before or during it."""
        if self.signalled:
            coro.close()
            raise asyncio.CancelledError
        self._starting = asyncio.ensure_future(coro)
        try:
            return await self._starting
        finally:
            self._starting = None

    def _on_signal(self) -> None:
        if self.signalled and self.server is not None:
            self.server.force_exit = True   # a second signal: skip the graceful wait
        self.signalled = True
        self.client.begin_shutdown()        # stop accepting; in-flight requests end with 503 now
        if self._starting is not None:
            self._starting.cancel()
        if self.server is not None:
            self.server.should_exit = True

    # ---- engine failure ------------------------------------------------------------------------------------
    def on_dead(self) -> None:
        """A replica died (not at shutdown)."""
        if self.exit_on_failure and self._drain is None and self.server is not None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        down = "; ".join(f"replica {i}: {c.dead}" for i, c in enumerate(self.client.clients) if c.dead is not None)
        self.client.stop_accepting(f"an engine replica is down ({down}); the server is restarting")
        deadline = now() + self.grace_s
        open_at_start = len(self.client.reqs)
        while self.client.reqs and now() < deadline and not self.signalled:
            await asyncio.sleep(DRAIN_POLL_S)
        left = len(self.client.reqs)
        log.error("engine failure: %d request(s) on the other replicas finished, %d cut with 503; exiting",
                  open_at_start - left, left)
        self.client.begin_shutdown()        # what is left gets its 503 / error event now
        await asyncio.sleep(DRAIN_POLL_S)   # the handlers write those answers before uvicorn closes
        self.server.should_exit = True
