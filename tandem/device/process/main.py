"""The device process's side of process/executor.py: `python -m tandem.device.process.main` (ranks.spawn_device)
connects back to the runner, builds the model_runner (alone, tp rank 0 or a pipeline stage) and runs every step
the runner launches, reading it from the shared buffers and writing the sampled ids back (process/executor.py says
how, and why a process rather than a thread).
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

import numpy as np

from ...lifeline import die_with_parent
from ...trace.device_profile import DeviceProfile
from ..parallel import step_wire
from ..ranks import rank_device
from .buffers import SharedBuffers, write_results
from ..step import StepInput
from ..streams import now

_LAUNCH = struct.Struct("<cqq")    # b"L", step id, buffer index; b"M" (same layout): its token masks are written
_DONE = struct.Struct("<cqddd")    # b"D", step id, forward start, forward end, seconds in tp collectives;
#                                   b"S" (same layout): a pipeline stage's own span and seconds in its sends


class _SchedulerGone(Exception):
    """The scheduler's end of the connection closed (it exited or was killed): the device process exits quietly.

    Raised by every send or receive on that connection in device_main, so a kill that lands while a step runs
    (its "done" then meets a broken pipe) ends the process the same way as one that lands while it waits."""


@contextlib.contextmanager
def _scheduler_link():
    """Turns a closed scheduler connection (EOF, broken pipe, reset) into _SchedulerGone."""
    try:
        yield
    except (EOFError, OSError) as e:
        raise _SchedulerGone() from e


def device_main(sock: str, shm_path: str, threads: int) -> None:
    die_with_parent()
    import torch
    torch.set_num_threads(threads)     # per OS thread: set here, in the thread that runs the forward
    authkey = sys.stdin.buffer.read()
    conn = Client(sock, family="AF_UNIX", authkey=authkey)
    tp = pp = profile = relay = None
    lock = threading.Lock()           # the pp result relay's thread sends on conn too

    def send(msg: bytes) -> None:
        with lock, _scheduler_link():
            conn.send_bytes(msg)
    try:
        spec, sizes, dist = conn.recv()
        buffers = SharedBuffers(shm_path, *sizes[:5], create=False, slots=sizes[5])
        from ..model_runner import ModelRunner
        if dist is not None and spec.pp_size > 1:      # a pipeline stage: its layers, p2p to its neighbours
            from ..parallel.pp import PPGroup
            pp = PPGroup(dist, rank_device(spec.device, dist), spec.source.config.num_layers)
        elif dist is not None:             # tp rank 0: join the group, then broadcast every step to it
            from ..parallel.tp import TPGroup
            tp = TPGroup(dist, rank_device(spec.device, dist))
        model_runner = ModelRunner(spec, tp=tp, pp=pp)
        profile = DeviceProfile.from_env()         # benchmarks only (trace/device_profile.py)
        send(pickle.dumps(("ready", (model_runner.num_slots, model_runner.max_context,
                                     tp.transport if tp is not None else None))))
        if pp is not None and pp.relay:    # the last stage is on another node: its results come through here
            from ..parallel.pp_stage import ResultRelay
            relay = ResultRelay(pp, buffers, lambda sid, t0: send(_DONE.pack(b"D", sid, t0, now(), 0.0)),
                                lambda: send(pickle.dumps(("error", (traceback.format_exc(),)))))
            relay.start()
        link = tp if tp is not None else pp if pp is not None and pp.passes_step else None   # keeps peers awake
        early: set[int] = set()              # steps whose mask message came before they were run
        later: collections.deque[bytes] = collections.deque()   # launches that came while a step waited

        def masks_of(step: StepInput, buf: int):
            def wait() -> np.ndarray:
                # The grammar branch: the forward is done; sampling waits for the host's masks.
                while not step.mask_ready and step.step_id not in early:
                    with _scheduler_link():
                        msg = conn.recv_bytes()
                    if msg[:1] == b"M":
                        early.add(_LAUNCH.unpack(msg)[1])
                    else:
                        later.append(msg)
                early.discard(step.step_id)
                return buffers.masks[buf][:len(step.grammar_rows)]
            return wait

        while True:
            with _scheduler_link():
                idle = link is not None and not later and not conn.poll(step_wire.KEEPALIVE_S)
                msg = b"" if idle else later.popleft() if later else conn.recv_bytes()
            if idle:
                link.keepalive()            # idle: the other ranks' collective timeout must not fire
                continue
            start = now()           # the device span: from the launch message in hand to the ids written back
            if msg == b"Q":
                if link is not None:
                    link.quit()
                return
            kind, step_id, buf = _LAUNCH.unpack(msg)
            if kind == b"M":                # the masks of a step not yet run (it is next)
                early.add(step_id)
                continue
            step = StepInput.unpack(step_id, buffers.ints[buf], buffers.floats[buf])
            if pp is not None:
                pp.comm_s = 0.0
            if tp is not None:
                tp.send_step(step_id, step, buffers.ints[buf], buffers.floats[buf])
            if relay is not None:
                relay.expect(step_id, buf, start)
            if link is pp and pp is not None:       # the next stage is on another node: the step goes first
                pp.send_step(step_wire.STEP, step_id, step, buffers.ints[buf], buffers.floats[buf])
            b = step.batch_size
            with profile.step(b, step.num_tokens) if profile is not None else contextlib.nullcontext():
                tokens = model_runner.run_step(step, masks_of(step, buf))
                if pp is not None:          # this stage's own span: from its input in hand (the trace's pipeline)
                    send(_DONE.pack(b"S", step_id, start if pp.first else pp.recv_done, now(), pp.comm_s))
                if tokens is None:          # a pipeline stage but the last: its hidden states went on
                    if relay is not None and len(step.grammar_rows):
                        relay.send_masks(masks_of(step, buf)())      # to the last stage, on another node
                    continue
                write_results(buffers.outs[buf], buffers.lp_outs[buf], b, tokens, model_runner.last_logprobs,
                              model_runner.last_prompt_logprobs)
            send(_DONE.pack(b"D", step_id, start, now(), tp.comm_s if tp is not None else 0.0))
    except _SchedulerGone:
        if link is not None:
            link.quit(quiet=True)
        return                              # the scheduler is gone: exit with it (the other ranks too)
    except BaseException:
        try:
            send(pickle.dumps(("error", (traceback.format_exc(),))))
        except _SchedulerGone:
            pass
        raise
    finally:
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
