"""ProcessExecutor: the executor of the CPU device process, whose model runner owns weights, KV cache and
FutureMap and runs steps while the scheduler works.

Measured on this 2-core machine (ARCHITECTURE.md section 5), a worker thread gives no real overlap because
the GIL convoys the forward's Python between ops; a process does. A launch is a 17-byte message over a unix
socket; the step's index arrays travel through shared memory (double-buffered: the buffers of step k are
rewritten only at launch k+2, after the host has processed step k). Sampled ids come back through shared
memory, and the "done" message is the copy_done event the scheduler waits on.

The process (process/main.py) is started with `python -m tandem.device.process.main` (not multiprocessing's spawn,
which re-imports the user's __main__), dies with its parent (socket EOF and PR_SET_PDEATHSIG), and a crash in it
surfaces in the scheduler as DeviceProcessError, never a hang.

With tp_size > 1 the device process is tp rank 0 (device/parallel/tp.py): the executor also starts this node's
other ranks (device/parallel/tp_worker.py) and watches every one of them; a rank that dies fails the step
(DeviceProcessError). With pp_size > 1 the executor starts one such process per pipeline stage
(device/parallel/pp.py): every stage reads the step from the shared buffers (one slot per micro-batch in flight),
only the last one writes the sampled ids and sends "done", and the executor relays those ids to the first stage
with the next launch.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import struct
import subprocess
import time
from multiprocessing.connection import Listener, wait

import numpy as np

from ... import runtime_files
from ...grammar.compiler import mask_words
from ...sampler import MAX_BIASES, MAX_LOGPROBS
from .. import step as step_mod
from ..kv_disk import join_words
from ..runner_spec import RunnerSpec
from ..ranks import rank_infos, spawn_device, spawn_rank
from .buffers import SharedBuffers, read_logprobs
from ..step import StepInput
from .main import _DONE, _LAUNCH, PING
from ..streams import now


class DeviceProcessError(RuntimeError):
    """The device process failed or died; the engine cannot continue."""


class ProcessHandle:
    def __init__(self, executor: "ProcessExecutor", step: StepInput, buf: int) -> None:
        self.step_id = step.step_id
        self._executor, self._buf, self._b = executor, buf, step.batch_size
        self._result: np.ndarray | None = None
        self._rows = step.rows if executor.pp_size > 1 else None    # the FutureMap relay's rows
        self._span = (0.0, 0.0)
        self.comm_s = 0.0          # the step's time in tp collectives (after wait())
        self.stage_spans: tuple = ()   # pp: each of this node's stages' (stage, busy start, end, send seconds)

    def send_masks(self, masks: np.ndarray) -> None:
        """The grammar branch: the token masks of this step's grammar rows, once the host has them."""
        self._executor._write_masks(self._buf, masks)
        self._executor._send(_LAUNCH.pack(b"M", self.step_id, self._buf))

    def ready(self) -> bool:
        """Has the step's "done" come (read by wait() or the executor's poll_done)? Never blocks."""
        return self._result is not None or self.step_id in self._executor._done

    def wait(self) -> np.ndarray:
        if self._result is None:
            *span, self.comm_s = self._executor._wait_done(self.step_id)  # copy_done.wait()
            self._span = tuple(span)
            self._result = self._executor.buffers.outs[self._buf][:self._b].copy()
            if self._rows is not None:     # the next launch relays them to the first stage (device/parallel/pp.py)
                self._executor.relay.update(zip(self._rows.tolist(), self._result.tolist()))
                self.stage_spans = self._executor.stage_spans(self.step_id)
        return self._result

    def logprobs(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chosen [B], top ids [B, k], top logprobs [B, k]) after wait(), for a step whose rows asked."""
        return read_logprobs(self._executor.buffers.outs[self._buf], self._executor.buffers.lp_outs[self._buf],
                              self._b, k)

    def prompt_logprobs(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same for the step's n prompt positions (prompt_logprob_targets), after wait()."""
        o = self._b * (1 + MAX_LOGPROBS)
        return read_logprobs(self._executor.buffers.outs[self._buf][o:], self._executor.buffers.lp_outs[self._buf][o:],
                              n, k)

    def embeddings(self, n: int) -> np.ndarray:
        """[n, hidden] float32 after wait(): the step's embeddings rows' raw pooled vectors (device/embed.py)."""
        h = self._executor._spec.source.config.hidden_size
        return self._executor.buffers.emb_outs[self._buf][:n * h].reshape(n, h).copy()

    @property
    def device_span(self) -> tuple[float, float]:
        return self._span


class ProcessExecutor:
    def __init__(self, spec: RunnerSpec, device_threads: int, max_tokens_per_step: int,
                 start_timeout: float = 600.0, max_prefix_slots: int = 0, nnodes: int = 1,
                 dist_init_addr: str | None = None, nests_steps: bool = False) -> None:
        # Urgent steps (scheduler/urgent.py): the device runs them between two layers of a long step, which holds
        # its buffer slot meanwhile; a third slot lets a second urgent step follow the first before it ends.
        self.nests_steps = nests_steps and spec.pp_size == 1 and spec.tp_size == 1
        b = spec.max_running + spec.max_draft_rows      # batch rows a step may carry (draft rows included)
        # StepInput.pack: header, the row fields, then the VAR fields, each bounded: ids and slots (a token
        # each), poisoned and grammar rows (<= rows), prefix slots and the penalized rows' prefix ids (<= the
        # prefix slots), logit biases (<= MAX_BIASES a row).
        bias = MAX_BIASES * b
        self.pp_size = spec.pp_size
        relay = 2 * (spec.max_running + 1) if spec.pp_size > 1 else 0       # a row and its id, per table row
        # a hybrid's state copies: a save per released row, a restore and a save per batch row at most
        state = 3 * (spec.max_running + spec.spare_rows + 1 + 2 * b) if spec.source.config.linear_layers else 0
        # the disk tier's saves and loads: max_tokens_per_step tokens of each a step (DiskTier.max_op_tokens), a
        # chunk's key and lengths besides its slots, a partial first chunk a row
        disk = 4 * max_tokens_per_step + 8 * b if spec.kv_disk_folder else 0
        if disk and spec.source.config.linear_layers:      # a state entry a checkpoint at most, each way
            disk += 2 * (spec.max_running + spec.spare_rows + 1 + spec.state_checkpoints) * (6 + 64)
        int_words = step_mod.HEADER + (len(step_mod.ROW_INTS) + 2) * b + 2 * max_tokens_per_step + \
            2 * max_prefix_slots + 2 * bias + relay + state + disk
        float_words = len(step_mod.ROW_FLOATS) * b + bias
        self._tmp = runtime_files.make_dir("dev", runtime_files.shm_dir())
        shm_path = os.path.join(self._tmp, "steps")
        out_words = (b + max_tokens_per_step) * (1 + MAX_LOGPROBS)     # sampled rows' part, prompt positions' part
        # One buffer slot per step in flight: 2 (the overlap loop's k and k-1), pp_size under the PP loop.
        emb_floats = spec.max_running * spec.source.config.hidden_size     # every row an embeddings row at most
        self.buffers = SharedBuffers(shm_path, int_words, float_words, out_words, b,
                                      mask_words(spec.source.config.vocab_size), create=True,
                                      slots=max(3 if self.nests_steps else 2, spec.pp_size), emb_floats=emb_floats)
        sock = os.path.join(self._tmp, "sock")
        authkey = os.urandom(16)
        listener = Listener(sock, family="AF_UNIX", authkey=authkey)
        # pp: one device process per stage (self.proc the first, self.ranks the others, in stage order once
        # they connect, as self.conns).
        # pp over several nodes: this node's stages here (the first pp_size / nnodes), the others started by
        # `tandem serve --node-rank R` there (device/parallel/pp_stage.py).
        pp_init = f"tcp://{dist_init_addr}" if nnodes > 1 else f"file://{self._tmp}/pp-store"
        self._stages = rank_infos(spec.pp_size, nnodes, 0, device_threads, pp_init) if spec.pp_size > 1 else [None]
        procs = [spawn_device(sock, shm_path, device_threads, authkey) for _ in self._stages]
        self.proc = procs[0]
        self.dist = None                    # rank 0's DistInfo under tp; the other ranks of this node:
        self.ranks: list[subprocess.Popen] = procs[1:]
        self.relay: dict[int, int] = {}     # pp: request-table row -> id sampled there, not yet relayed
        if spec.tp_size > 1:
            init = f"tcp://{dist_init_addr}" if nnodes > 1 else f"file://{self._tmp}/tp-store"
            self.dist, *others = rank_infos(spec.tp_size, nnodes, 0, device_threads, init, spec.tp_comm)
            self.ranks = [spawn_rank(spec, info) for info in others]
        self._done: dict[int, tuple[float, float, float]] = {}
        self._stages_of: dict[int, dict[int, tuple]] = {}     # pp: step -> stage -> its span (stage_spans)
        self._closed = False
        self._listener, self._shm_path, self._spec, self._timeout = listener, shm_path, spec, start_timeout
        self.num_slots = self.max_context = 0
        self.tp_transport: str | None = None     # "shm", "gloo" or "nccl": how the tp ranks reduce (after start)
        self.pp_cut: list[int] | None = None      # pipeline stages: each stage's layer count (device/parallel/pp_split.py)

    def wait_ready(self) -> None:
        """Finish the start: hand over the spec and wait until the weights and KV cache are in place.
        Split from __init__ so the scheduler's process can load its tokenizer meanwhile."""
        if self.num_slots:
            return
        listener, shm_path = self._listener, self._shm_path
        try:
            # Stages are numbered in the order they connect (each reads its number from its DistInfo).
            self.conns = []
            for stage in self._stages:
                self.conns.append(self._accept(listener, self._timeout))
                self.conns[-1].send((self._spec, self.buffers.sizes, stage if stage else self.dist))
            self.conn = self.conns[-1]          # the last stage (the only one without pp) sends results
            if self.pp_size > 1:                # self.proc, self.ranks in stage order, as self.conns
                by_pid = {p.pid: p for p in [self.proc, *self.ranks]}
                self.proc, *self.ranks = [by_pid[_peer_pid(c)] for c in self.conns]
            for conn in self.conns:
                info = self._recv(conn, [conn])
                if info[0] != "ready":
                    raise DeviceProcessError(f"device process sent {info[0]!r} at start")
        except BaseException:
            self.shutdown()
            raise
        finally:
            try:
                listener.close()        # unlinks its socket, already gone if shutdown() removed the folder
            except FileNotFoundError:
                pass
            try:
                os.unlink(shm_path)   # both sides hold the mapping; nothing is left behind on a crash
            except FileNotFoundError:
                pass
        self.num_slots, self.max_context, self.tp_transport, self.pp_cut = info[1], info[2], info[3], info[4]
        self.kv_slot_bytes = info[5]

    def _accept(self, listener: Listener, timeout: float):
        """Accept the device process's connection, failing fast if it dies before connecting."""
        raw = listener._listener._socket
        raw.settimeout(1.0)
        deadline = now() + timeout
        while True:
            try:
                return listener.accept()
            except socket.timeout:
                if self._dead() is not None:
                    raise self._died() from None
                if now() > deadline:
                    raise DeviceProcessError("device process did not connect in time") from None

    defers_masks = True       # a step's grammar masks may follow its launch (the device waits before sampling)

    @property
    def buffer_slots(self) -> int:
        """Steps in flight at most: step k writes buffer slot k % buffer_slots."""
        return self.buffers.slots

    def launch_step(self, step: StepInput, masks: np.ndarray | None = None, yields: bool = False,
                    urgent: bool = False) -> ProcessHandle:
        """`yields`: the device runs urgent steps sent while this one runs between two of its layers; `urgent`:
        such a step (only with nests_steps; the scheduler keeps their invariants, scheduler/urgent.py)."""
        # Slot k % slots is rewritten only once step k - slots has been processed: at most `slots` in flight.
        buf = step.step_id % self.buffers.slots
        if masks is not None:
            self._write_masks(buf, masks)
        step.mask_ready = masks is not None or not len(step.grammar_rows)
        if self.relay:
            step.stash_rows = np.fromiter(self.relay.keys(), np.int64, len(self.relay))
            step.stash_ids = np.fromiter(self.relay.values(), np.int64, len(self.relay))
            self.relay = {}
        step.pack(self.buffers.ints[buf], self.buffers.floats[buf])
        kind = b"U" if urgent else b"Y" if yields else b"L"
        for conn in self.conns:             # every pipeline stage reads the step from the buffers
            self._send(_LAUNCH.pack(kind, step.step_id, buf), conn)
        return ProcessHandle(self, step, buf)

    def poll_done(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a message of the device process and take the "done"s that came
        (ProcessHandle.ready reads them); an error or a death raises DeviceProcessError, as wait() does."""
        while True:
            try:
                ready = self.conn.poll(timeout)
            except (OSError, EOFError) as e:
                raise self._died() from e
            if not ready:
                if self._dead() is not None:
                    raise self._died()
                return
            kind, sid, *times = self._recv()
            if kind == "done":
                self._done[sid] = tuple(times)
            timeout = 0                     # then only what has come already

    def probe(self) -> None:
        """Liveness: a no-op round trip to each device process of this node (its step loop answers at once).
        Returns once every one answered, so it blocks while one is stopped or stuck (the engine then sends
        nothing, which is what /health reads); DeviceProcessError if one died. Called only with no step in
        flight (the engine's idle loop, EngineProc.idle), never on a step's path."""
        for conn in self.conns:
            self._send(PING, conn)
        for conn in self.conns:
            while True:
                kind, *rest = self._recv(conn, [conn])
                if kind == "pong":
                    break
                if kind == "done":              # not expected with nothing in flight; kept, never dropped
                    self._done[rest[0]] = tuple(rest[1:])

    def _write_masks(self, buf: int, masks: np.ndarray) -> None:
        self.buffers.masks[buf][:len(masks)] = masks

    def save_kv(self, saves: np.ndarray, state_saves: np.ndarray, state_ops: np.ndarray) -> None:
        """The disk tier's saves (StepInput.kv_saves' and kv_state_saves' layouts), after a hybrid's queued
        checkpoint copies, with no step to ride: only with none in flight (the device reads this message in its step
        loop, never between two layers of a step)."""
        self._send(b"K" + join_words(saves, state_saves, state_ops).tobytes())

    def _send(self, msg: bytes, conn=None) -> None:
        """To `conn`, by default the sampling device process (the last stage: grammar masks go there)."""
        try:
            (conn or self.conn).send_bytes(msg)
        except (OSError, EOFError) as e:
            raise self._died() from e

    def _recv(self, conn=None, watch: list | None = None):
        """The next message of `conn` (default: the sampling process: the last stage). The other stages of
        `watch` (default: all) send only to fail: their error is raised here."""
        conn = conn or self.conn
        watch = self.conns if watch is None else watch
        while True:
            try:
                ready = wait(watch, 1.0) if len(watch) > 1 else [conn] if conn.poll(1.0) else []
                for other in (c for c in ready if c is not conn):
                    self._decode(other.recv_bytes(), self.conns.index(other))
                if conn in ready:
                    msg = conn.recv_bytes()
                    break
            except (OSError, EOFError) as e:
                raise self._died() from e
            if self._dead() is not None:
                raise self._died()
        return self._decode(msg, self.conns.index(conn))

    def _decode(self, msg: bytes, sender: int):
        if msg[:1] in b"DS":
            kind, step_id, start, end, comm = _DONE.unpack(msg)
            if kind == b"S":                # a pipeline stage's own span of a step (process/main.py)
                self._stages_of.setdefault(step_id, {})[sender] = (sender, start, end, comm)
                return ("stage", step_id)
            return ("done", step_id, start, end, comm)
        kind, payload = pickle.loads(msg)
        if kind == "error":
            if self.pp_size > 1:            # a stage fails when its neighbour dies: name the one that died
                time.sleep(0.2)
                if (dead := self._dead(exclude=sender)) is not None:
                    raise DeviceProcessError(f"{dead[0]} died (exit code {dead[1]}); pipeline stage {sender} "
                                             f"then failed: {payload[0].strip().splitlines()[-1]}")
            raise DeviceProcessError(f"device process failed:\n{payload[0]}")
        return (kind, *payload)

    def _wait_done(self, step_id: int) -> tuple[float, float, float]:
        while step_id not in self._done:
            kind, sid, *times = self._recv()
            if kind == "done":
                self._done[sid] = tuple(times)
        return self._done.pop(step_id)

    def stage_spans(self, step_id: int) -> tuple:
        """The stages' spans of a step that was waited for: each stage sends its own after its forward, so
        the earlier stages' are in (a span still unread then is read now, one that is late is left out)."""
        others = [c for c in self.conns if c is not self.conn]
        try:
            for c in wait(others, 0) if others else []:
                self._decode(c.recv_bytes(), self.conns.index(c))
        except (OSError, EOFError) as e:
            raise self._died() from e
        spans = self._stages_of.pop(step_id, {})
        return tuple(spans[k] for k in sorted(spans))

    def _dead(self, exclude: int = -1) -> tuple[str, int] | None:
        """(which, exit code) of the first of this node's device processes that has exited."""
        for i, p in enumerate([self.proc, *self.ranks]):
            if i != exclude and p.poll() is not None:
                if self.pp_size > 1:
                    return (f"pipeline stage {i}", p.returncode)
                return ("device process" if i == 0 else f"tp rank {self.dist.rank + i}", p.returncode)
        return None

    def _died(self) -> DeviceProcessError:
        """The error to raise; a lost connection waits a moment for its process's exit to name it."""
        dead = self._dead()
        for _ in range(20 if dead is None else 0):
            time.sleep(0.05)
            if (dead := self._dead()) is not None:
                break
        return DeviceProcessError(f"{dead[0]} died (exit code {dead[1]})" if dead is not None
                                  else "lost the connection to the device process")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in getattr(self, "conns", []):
            try:
                conn.send_bytes(b"Q")
                conn.close()
            except (OSError, EOFError):
                pass
        starting = not getattr(self, "num_slots", 0)   # start-up cancelled (a signal, a failed stage): still loading
        for p in [self.proc, *self.ranks]:   # rank 0 tells the others to quit; a stuck one is killed
            if starting:
                # A loading process reads no quit until its weights are in (seconds under --pp, a stage after
                # another); it holds nothing this process does not remove, so it is stopped now, not awaited.
                p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if starting:
            with contextlib.suppress(OSError):   # wait_ready never ran to close it (its socket is unlinked once)
                self._listener.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _peer_pid(conn) -> int:
    """The process id at the other end of a unix-socket connection (SO_PEERCRED: pid, uid, gid)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
