"""The device process's side of process/executor.py: `python -m tandem.device.process.main` (ranks.spawn_device)
connects back to the ProcessExecutor, builds the model runner (alone, tp rank 0 or a pipeline stage) and runs every
step the executor launches, reading it from the shared buffers and writing the sampled ids back (process/executor.py
says how, and why a process rather than a thread).
"""
from __future__ import annotations

import collections
import contextlib
import pickle
import struct
import sys
import threading
import traceback
from multiprocessing.connection import Client
from typing import Callable

import numpy as np

from ...lifeline import die_with_parent
from ..denormals import flush_denormals
from ..kv_disk import split_words
from ..heap import IDLE_TRIM_S, give_back_heap
from ..profile import DeviceProfile
from ..parallel import step_wire
from ..ranks import rank_device
from .buffers import SharedBuffers, write_results
from ..step import StepInput
from ..streams import now

_LAUNCH = struct.Struct("<cqq")    # b"L", step id, buffer index; b"M" (same layout): its token masks are written;
#                                   b"Y": a launch whose step runs the urgent steps (b"U") sent meanwhile between
#                                   two of its layers (_StepLoop.between)
_DONE = struct.Struct("<cqddd")    # b"D", step id, forward start, forward end, seconds in tp collectives;
#                                   b"S" (same layout): a pipeline stage's own span and seconds in its sends
PING = b"P"                        # the executor's liveness probe (ProcessExecutor.probe): answered with PONG at
PONG = pickle.dumps(("pong", ()))  # once, no work done; only sent while no step is in flight


class _SchedulerGone(Exception):
    """The scheduler's end of the connection closed (it exited or was killed): the device process exits quietly.

    Raised by every send or receive on that connection in this module, so a kill that lands while a step runs
    (its "done" then meets a broken pipe) ends the process the same way as one that lands while it waits."""


@contextlib.contextmanager
def _scheduler_link():
    """Turns a closed scheduler connection (EOF, broken pipe, reset) into _SchedulerGone."""
    try:
        yield
    except (EOFError, OSError) as e:
        raise _SchedulerGone() from e


def _sender(conn) -> Callable[[bytes], None]:
    """Sends one message to the scheduler; a lock, as the pp result relay's thread sends on conn too."""
    lock = threading.Lock()

    def send(msg: bytes) -> None:
        with lock, _scheduler_link():
            conn.send_bytes(msg)
    return send


def _error_message() -> bytes:
    """The traceback being handled, as the "error" the executor raises as DeviceProcessError."""
    return pickle.dumps(("error", (traceback.format_exc(),)))


def _join_group(spec, dist) -> tuple:
    """(tp, pp): this process's group, joined before the model runner is built on it (and closed by device_main
    even when that fails): a pipeline stage (its layers, p2p to its neighbours), tp rank 0 (it broadcasts every
    step to the group) or neither (alone)."""
    if dist is not None and spec.pp_size > 1:
        from ..parallel.pp import PPGroup
        return None, PPGroup(dist, rank_device(spec.device, dist), spec)
    if dist is not None:
        from ..parallel.tp import TPGroup
        return TPGroup(dist, rank_device(spec.device, dist)), None
    return None, None


class _StepLoop:
    """Runs every step the executor launches, until it says quit (b"Q")."""

    def __init__(self, conn, send: Callable[[bytes], None], buffers: SharedBuffers, model_runner, tp, pp, relay,
                 profile, link) -> None:
        self.conn, self.send, self.buffers, self.model_runner = conn, send, buffers, model_runner
        self.tp, self.pp, self.relay, self.profile, self.link = tp, pp, relay, profile, link
        self.early: set[int] = set()              # steps whose mask message came before they were run
        self.later: collections.deque[bytes] = collections.deque()   # launches that came while a step waited
        self.nested = False                       # an urgent step runs between two layers of another

    def run(self) -> None:
        trimmed = True                           # no step ran since the heap was last given back
        while True:
            with _scheduler_link():
                if not trimmed and not self.later and not self.conn.poll(IDLE_TRIM_S):
                    give_back_heap()             # idle: the steps' freed activations go back to the system
                    trimmed = True
                    continue
                was_trimmed, trimmed = trimmed, False
                idle = self.link is not None and not self.later and not self.conn.poll(step_wire.KEEPALIVE_S)
                msg = b"" if idle else self.later.popleft() if self.later else self.conn.recv_bytes()
            if idle:
                self.link.keepalive()            # idle: the other ranks' collective timeout must not fire
            elif msg == PING:
                if self.tp is not None:          # every tp rank answers too (TPGroup.probe)
                    self.tp.probe()
                self.send(PONG)                  # a probe is no step: the heap stays trimmed if it was
                trimmed = was_trimmed
            elif not self.handle(msg):
                return

    def handle(self, msg: bytes) -> bool:
        """One message: a launch, the masks of a step not yet run, or the quit (then False)."""
        start = now()           # the device span: from the launch message in hand to the ids written back
        if msg == b"Q":
            if self.link is not None:
                self.link.quit()
            return False
        if msg[:1] == b"K":            # the disk tier's saves an idle scheduler sends (ProcessExecutor.save_kv)
            self.model_runner.save_kv(*split_words(np.frombuffer(msg[1:], np.int64), 3))
            return True
        kind, step_id, buf = _LAUNCH.unpack(msg)
        if kind == b"M":                # the masks of a step not yet run (it is next)
            self.early.add(step_id)
        else:                           # b"U" read here came after its long step's last layer: run as any
            self.launched(step_id, buf, start, yields=kind == b"Y")
        return True

    def between(self, layer: int) -> None:
        """The urgent-step branch, before layer `layer` of a step launched with b"Y": run each urgent step sent
        meanwhile here, to its end ("done" before the long step's); keep any other message for after. What
        makes this safe is on the scheduler's side (scheduler/urgent.py): an urgent step shares no request,
        request-table row or KV slot with the step it runs in."""
        while True:
            with _scheduler_link():
                if not self.conn.poll(0):
                    return
                msg = self.conn.recv_bytes()
            if msg[:1] == b"U":
                _, step_id, buf = _LAUNCH.unpack(msg)
                self.nested = True
                try:
                    with self.model_runner.nested():
                        self.launched(step_id, buf, now())
                finally:
                    self.nested = False
            elif msg[:1] == b"M":
                self.early.add(_LAUNCH.unpack(msg)[1])
            else:
                self.later.append(msg)

    def launched(self, step_id: int, buf: int, start: float, yields: bool = False) -> None:
        """A launched step: pass it on (tp ranks, the relay, the next stage on another node), run it, write its results
        and send "done" (a pipeline stage also its own span)."""
        buffers, tp, pp, relay = self.buffers, self.tp, self.pp, self.relay
        step = StepInput.unpack(step_id, buffers.ints[buf], buffers.floats[buf])
        if pp is not None:
            pp.comm_s = 0.0
        if tp is not None:
            tp.send_step(step_id, step, buffers.ints[buf], buffers.floats[buf])
        if relay is not None:
            relay.expect(step_id, buf, start)
        if self.link is pp and pp is not None:       # the next stage is on another node: the step goes first
            pp.send_step(step_wire.STEP, step_id, step, buffers.ints[buf], buffers.floats[buf])
        b = step.batch_size
        profiled = self.profile is not None and not self.nested
        with self.profile.step(b, step.num_tokens) if profiled else contextlib.nullcontext():
            out = self.model_runner.run(step, self.masks_of(step, buf), self.between if yields else None)
            if pp is not None:          # this stage's own span: from its input in hand (the trace's pipeline)
                self.send(_DONE.pack(b"S", step_id, start if pp.first else pp.recv_done, now(), pp.comm_s))
            if out is None:             # a pipeline stage but the last: its hidden states went on
                if relay is not None and len(step.grammar_rows):
                    relay.send_masks(self.masks_of(step, buf)())      # to the last stage, on another node
                return
            write_results(buffers.outs[buf], buffers.lp_outs[buf], b, out.tokens, out.logprobs, out.prompt_logprobs,
                          buffers.emb_outs[buf], out.embeddings)
        self.send(_DONE.pack(b"D", step_id, start, now(), tp.comm_s if tp is not None else 0.0))

    def masks_of(self, step: StepInput, buf: int) -> Callable[[], np.ndarray]:
        """The step's masks() for the model runner's run(): it reads the messages that come meanwhile, until
        the step's masks are written (a later launch waits in `later`)."""
        def wait() -> np.ndarray:
            # The grammar branch: the forward is done; sampling waits for the host's masks.
            while not step.mask_ready and step.step_id not in self.early:
                with _scheduler_link():
                    msg = self.conn.recv_bytes()
                if msg[:1] == b"M":
                    self.early.add(_LAUNCH.unpack(msg)[1])
                else:
                    self.later.append(msg)
            self.early.discard(step.step_id)
            return self.buffers.masks[buf][:len(step.grammar_rows)]
        return wait


def device_main(sock: str, shm_path: str, threads: int) -> None:
    """Connect back to the executor, build the model runner, report ready, then run the step loop. A closed
    connection ends the process quietly; any other failure goes to the executor as "error" first."""
    die_with_parent()
    import torch
    flush_denormals()                  # before the first parallel region: its threads inherit it
    torch.set_num_threads(threads)     # per OS thread: set here, in the thread that runs the forward
    authkey = sys.stdin.buffer.read()
    conn = Client(sock, family="AF_UNIX", authkey=authkey)
    tp = pp = profile = relay = link = model_runner = None
    send = _sender(conn)
    try:
        spec, sizes, dist = conn.recv()
        buffers = SharedBuffers(shm_path, *sizes[:5], create=False, slots=sizes[5], emb_floats=sizes[6])
        from ..model_runner import ModelRunner
        tp, pp = _join_group(spec, dist)
        model_runner = ModelRunner(spec, tp=tp, pp=pp)
        profile = DeviceProfile.from_env()         # benchmarks only (device/profile.py)
        send(pickle.dumps(("ready", (model_runner.num_slots, model_runner.max_context,
                                     tp.transport if tp is not None else None, pp.cut if pp is not None else None,
                                     model_runner.kv_slot_bytes))))
        if pp is not None and pp.relay:    # the last stage is on another node: its results come through here
            from ..parallel.pp_stage import ResultRelay
            relay = ResultRelay(pp, buffers, lambda sid, t0: send(_DONE.pack(b"D", sid, t0, now(), 0.0)),
                                lambda: send(_error_message()))
            relay.start()
        link = tp if tp is not None else pp if pp is not None and pp.passes_step else None   # keeps peers awake
        _StepLoop(conn, send, buffers, model_runner, tp, pp, relay, profile, link).run()
    except _SchedulerGone:
        if link is not None:
            link.quit(quiet=True)
        return                              # the scheduler is gone: exit with it (the other ranks too)
    except BaseException:
        try:
            send(_error_message())
        except _SchedulerGone:
            pass
        raise
    finally:
        if model_runner is not None and model_runner.kv_disk is not None:
            model_runner.kv_disk.flush()    # the disk tier's queued writes land before the exit (a restart hits)
        if profile is not None:
            profile.write()
        if tp is not None:
            tp.close()
        if relay is not None:
            relay.join(timeout=5.0)         # its quit comes back around the pipeline
        if pp is not None:
            pp.close()


if __name__ == "__main__":
    device_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
