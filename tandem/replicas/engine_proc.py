"""The engine process: the scheduler loop and the model, fed over ZMQ by the frontend.

Started by the frontend as `python -m tandem.replicas.engine_proc IN_ADDR OUT_ADDR [CPUS]` with the pickled
EngineConfig on stdin; CPUS ("0,1") pins it, and so its device process, to those cores (a data-parallel
replica's share, see replicas.py). It dies with its parent (PR_SET_PDEATHSIG); it runs in a session of its
own, so a terminal's Ctrl-C reaches only the frontend, which stops it in order (Shutdown: abort all, then exit).
Nothing a client sends reaches this interpreter except validated token ids and sampling fields, and every
error in building a request is answered as a rejection, never raised into the loop.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback

import zmq

from ..config import EngineConfig
from ..device.streams import now
from ..engine import Engine
from ..lifeline import die_with_parent
from ..request import StepOutput
from ..trace.recorder import busy_time
from ..sampling_params import SamplingParams
from . import ipc

IDLE_POLL_MS = 50         # idle(): block this long on the request socket, then let the loop look again
IDLE_WINDOW_S = 10.0      # device_idle_fraction covers the device steps of the last IDLE_WINDOW_S
IDLE_EVERY_S = 1.0        # ... recomputed at most this often
HEARTBEAT_S = 0.5         # the loop sends something at least this often while it turns (the frontend's /health)

# Liveness (the frontend's /health and refusal read how long the engine has been silent): a heartbeat is sent
# only when the device has answered since the previous message, by completing a step (busy) or a probe (idle:
# EngineProc.idle sends a no-op round trip to the device processes once no step completed for HEARTBEAT_S).
# So a stuck step, a stuck loop and a stopped or stuck idle device all silence the engine alike, and /health
# turns 503 within --health-timeout of it; once the device answers again the heartbeats resume. The probe is
# never on a step's path: the idle loop alone sends it, at most once per HEARTBEAT_S.


class EngineProc:
    def __init__(self, config: EngineConfig, rx: zmq.Socket, tx: zmq.Socket) -> None:
        self.rx, self.tx = rx, tx
        self.engine = Engine(config, sink=self.sink, poll=self.poll)
        self.live: set[str] = set()        # accepted, not yet finished
        self.stopping = False
        self._last_stats: dict | None = None
        self._idle_at, self._idle = -1e18, 0.0
        self._sent_at = now()
        self._probed_at = float("-inf")   # when the device processes last answered a probe

    def send(self, msg) -> None:
        self.tx.send(ipc.encode(msg))
        self._sent_at = now()

    # ---- called by the scheduler loop ----------------------------------------------------------------------
    def poll(self) -> None:
        """Every loop iteration: pull pending messages (non-blocking) and answer each AddRequest."""
        replies = []
        while True:
            try:
                msg = ipc.decode(self.rx.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, ipc.AddRequest):
                replies.append(self._add(msg))
            elif isinstance(msg, ipc.AbortRequest):
                if msg.rid in self.live:
                    self.engine.abort(msg.rid)
            elif isinstance(msg, ipc.Shutdown):
                self.stopping = True
                for rid in self.live:
                    self.engine.abort(rid)
        if replies:
            self.send(ipc.Replies(replies))
        elif now() - self._sent_at > HEARTBEAT_S and self._device_seen() > self._sent_at:
            # Heartbeat: the loop is turning and the device answered since the last message. A loop stuck in
            # a step (a hung device) sends nothing; an idle one probes its device first (idle()).
            self._heartbeat()

    def _device_seen(self) -> float:
        return max(self.engine.device_seen(), self._probed_at)

    def _heartbeat(self) -> None:
        self._last_stats = self.stats()
        self.send(ipc.Stats(self._last_stats))

    def _add(self, msg: ipc.AddRequest) -> list:
        if self.stopping:
            return [msg.rid, 503, "the server is shutting down"]
        try:
            req = self.engine.make_request(msg.prompt_ids, SamplingParams(**msg.params), msg.rid)
            self.engine.add_request(req)
        except OverflowError as e:
            return [msg.rid, 503, str(e)]
        except ValueError as e:
            return [msg.rid, 400, str(e)]
        except Exception as e:          # a bad request must never take the loop down
            traceback.print_exc()
            return [msg.rid, 400, f"{type(e).__name__}: {e}"]
        self.live.add(msg.rid)
        return [msg.rid, ipc.ACCEPTED, ""]

    def sink(self, outputs: list[StepOutput]) -> None:
        """Once per processed step: all of its outputs in one message, with the state after it."""
        for o in outputs:
            if o.finished:
                self.live.discard(o.rid)
        self._last_stats = self.stats()
        self.send(ipc.Outputs(outputs, self._last_stats))

    def idle(self) -> bool:
        """Nothing to schedule: publish changed stats, then wait briefly for messages. False ends the loop."""
        if self.stopping:
            return False
        if now() - self._sent_at > HEARTBEAT_S and self._device_seen() <= self._sent_at:
            # Liveness of an idle device: nothing proved it alive since the last message. Blocks while a device
            # process is stopped or stuck (the engine is then silent: /health 503); raises if one died.
            self.engine.probe_device()
            self._probed_at = now()
            self._heartbeat()
        stats = self.stats()
        if stats != self._last_stats:
            self._last_stats = stats
            self.send(ipc.Stats(stats))
        grammars = self.engine.scheduler.grammars
        self.rx.poll(1 if grammars is not None and grammars.compiling else IDLE_POLL_MS)   # a grammar about to be ready
        return True

    # ---- stats ---------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.engine.stats(), "device_idle_fraction": self._idle_fraction()}

    def _idle_fraction(self) -> float:
        """1 - busy / span over the device steps that ended in the last IDLE_WINDOW_S (0 when none ran)."""
        t = now()
        if t - self._idle_at >= IDLE_EVERY_S:
            self._idle_at = t
            recent = []
            for d in reversed(self.engine.recorder.devices):     # newest first
                if d.end < t - IDLE_WINDOW_S:
                    break
                recent.append(d)
            busy = busy_time(recent)                            # urgent steps' spans lie inside others'
            window = (max(d.end for d in recent) - min(d.start for d in recent)) if recent else 0.0
            self._idle = max(0.0, 1.0 - busy / window) if window > 0 else 0.0
        return self._idle


def main(in_addr: str, out_addr: str, cpus: str | None = None) -> int:
    die_with_parent()
    if cpus:                   # a replica's share of the cores: the device process it spawns inherits it
        cores = [int(c) for c in cpus.split(",")]
        os.sched_setaffinity(0, cores)
        import torch
        torch.set_num_threads(len(cores))      # this process's own torch ops (its pool was sized at import)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the finally: stop the device process
    config: EngineConfig = pickle.loads(sys.stdin.buffer.read())
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    rx.connect(in_addr)
    tx.setsockopt(zmq.LINGER, 2000)
    tx.connect(out_addr)
    proc, code = None, 0
    try:
        proc = EngineProc(config, rx, tx)
        e = proc.engine
        proc.send(ipc.Ready(e.model_name, min(e.max_context, e.executor.num_slots), e.model_config.vocab_size,
                            os.getpid()))
        e.run(proc.idle)
    except BaseException as exc:
        traceback.print_exc()
        try:                   # never block here: with the frontend gone, a PUSH socket has no peer to take it
            tx.send(ipc.encode(ipc.Failed(f"{type(exc).__name__}: {exc}")), zmq.NOBLOCK)
        except zmq.Again:
            pass
        code = 1
    finally:
        if proc is not None:
            proc.engine.shutdown()
        rx.close(0)
        tx.close()
        ctx.term()
    return code


if __name__ == "__main__":
    code = main(*sys.argv[1:4])
    # Everything is closed (device process, sockets); skip the interpreter's teardown of torch (~1 s here),
    # as multiprocessing does for its workers, so that the server stops promptly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
