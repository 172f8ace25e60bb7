"""The forward's collectives through one shared-memory segment, for tensor-parallel ranks on one host.

gloo over loopback costs ~0.3 ms a call and a decode step makes ~64 calls (benchmarks/results/tp.md). Ranks
on one host can instead write their parts into a segment that every rank maps and read each other's parts:
two passes over memory and a wait on a flag (DeepSpeed's, SGLang's and vLLM's CPU backends do the same).
The torch.distributed group stays underneath: it does the rendezvous (the segment's path) and every
collective of ranks that do not share a host (ShmComm.join returns None for them).

Segment layout, one file in /dev/shm (unlinked once every rank has mapped it, so no exit leaves it behind):
    flags  int64 [size, 8]                   flags[r, 0]: the last op rank r posted (a 64-byte line each)
    slots  uint8 [2, size, SLOT_BYTES]       slots[s % 2, r]: rank r's part of op s
Invariant: op s writes slots[s % 2], last used by op s - 2. Every rank has finished op s - 2 once every flag
reads >= s - 1 (a rank posts s - 1 only after reading op s - 2's parts): each op checks that before writing.
An op larger than a slot goes in slot-sized chunks, one op number each.

Memory order: the parts are written before the flag, and read after it. x86 keeps stores in program order
and loads in program order (TSO), so plain stores and loads suffice there; join() picks gloo elsewhere.
"""
from __future__ import annotations

import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import runtime_files
from ...model.row_parallel import add_in_order

SLOT_BYTES = 4 << 20        # a rank's part of one op: [2048, 576] fp32 prefill activations in 2 chunks
_LINE = 8                   # int64 words per rank's flag (one cache line: ranks never write the same line)


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers' flags. Ranks may share cores (2 ranks and the scheduler on 2 cores
    here), so spinning is bounded: a spinning waiter would hold the core its peer needs to post."""
    spins: int = 300            # flag reads before the first yield (8 us on a free core, ~20 us under load)
    yield_s: float = 0.002      # then sched_yield between reads until this long has passed
    sleep_s: float = 50e-6      # then sleep this long between reads (a peer far behind, or gone)
    check_s: float = 0.05       # while sleeping, check this often that the peers are alive
    timeout_s: float = 600.0    # a peer that never posts is an error, as gloo's timeout is


@dataclass
class WaitStats:
    """How the waits ended, for measuring the policy: of `waits`, those that spun, yielded or slept (the
    rest found the flags posted), and the seconds the yielding and sleeping ones took."""
    waits: int = 0
    spun: int = 0
    yielded: int = 0
    slept: int = 0
    wait_s: float = 0.0


def host_key() -> tuple[str, ...]:
    """Ranks with equal keys can share a segment and each other's pids: the same host, boot, and mount and
    pid namespaces (two containers may share a hostname but not /dev/shm)."""
    def read(path: str, link: bool = False) -> str:
        try:
            return os.readlink(path) if link else open(path).read().strip()
        except OSError:
            return ""
    return (socket.gethostname(), read("/proc/sys/kernel/random/boot_id"), read("/proc/self/ns/mnt", True),
            read("/proc/self/ns/pid", True), platform.machine())


class ShmComm:
    def __init__(self, rank: int, size: int, path: str, create: bool, policy: WaitPolicy) -> None:
        self.rank, self.size, self.policy = rank, size, policy
        self.stats = WaitStats()
        nbytes = 8 * _LINE * size + 2 * size * SLOT_BYTES
        self._map = runtime_files.map_file(path, nbytes, create)
        self._flags = memoryview(self._map).cast("q")          # read flags[r * _LINE]: ~50 ns from Python
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = raw[8 * _LINE * size:].view(2, size, SLOT_BYTES)
        self._typed: dict = {}
        self._seq = 0
        self._pids: list[int] = []

    @classmethod
    def join(cls, rank: int, size: int, enabled: bool, policy: WaitPolicy = WaitPolicy()) -> "ShmComm | None":
        """Collective over the default group: a ShmComm when every rank is enabled and on one host (equal
        host_key) and the segment opens on every rank, else None (every rank decides the same)."""
        keys: list = [None] * size
        dist.all_gather_object(keys, (host_key(), enabled))
        if not all(k == (keys[0][0], True) for k in keys) or keys[0][0][-1] not in ("x86_64", "AMD64"):
            return None
        comm = folder = None
        if rank == 0:                                   # created before its path is sent: the others open it
            folder = runtime_files.make_dir("dev", runtime_files.shm_dir())
            comm = cls._open(rank, size, os.path.join(folder, "tp-shm"), True, policy)
        msg = [os.path.join(folder, "tp-shm") if comm is not None else None]
        dist.broadcast_object_list(msg, src=0)
        if rank > 0 and msg[0] is not None:
            comm = cls._open(rank, size, msg[0], False, policy)
        oks: list = [None] * size
        dist.all_gather_object(oks, None if comm is None else os.getpid())     # every rank has mapped it
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        if any(p is None for p in oks):
            if comm is not None:
                comm.close()
            return None
        comm._pids = oks
        return comm

    @classmethod
    def _open(cls, rank: int, size: int, path: str, create: bool, policy: WaitPolicy) -> "ShmComm | None":
        try:
            return cls(rank, size, path, create, policy)
        except OSError:
            return None

    # ---- the ops ---------------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum x over the ranks, in place; every rank adds the parts in rank order, so all get the same bits."""
        flat = x.view(-1)
        per = SLOT_BYTES // x.element_size()
        for o in range(0, flat.numel(), per):
            chunk = flat[o:o + per]
            s = self._begin()
            parts = self._parts(s, x.dtype)[:, :chunk.numel()]       # [size, n]
            parts[self.rank].copy_(chunk)
            self._post(s)
            self._wait(s, range(self.size))
            torch.add(parts[0], parts[1], out=chunk)
            for r in range(2, self.size):
                chunk.add_(parts[r])

    def all_reduce_in_order(self, parts: torch.Tensor, out: torch.Tensor) -> None:
        """out [n] = every rank's partials [c, n] added in (rank, chunk) order by add_in_order: the bits of
        one rank adding them all (model/row_parallel.py), whatever the number of ranks."""
        c, n = parts.shape
        per = SLOT_BYTES // (c * parts.element_size())
        for o in range(0, n, per):
            m = min(per, n - o)
            s = self._begin()
            slots = self._parts(s, parts.dtype)[:, :c * m].view(self.size, c, m)
            slots[self.rank].copy_(parts[:, o:o + m])
            self._post(s)
            self._wait(s, range(self.size))
            add_in_order([slots[r, j] for r in range(self.size) for j in range(c)], out[o:o + m])

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """[B, V] parts -> [B, size * V] on rank 0 (None elsewhere; rows of V too long for a slot raise)."""
        b, v = x.shape
        rows = SLOT_BYTES // (v * x.element_size())
        if rows < 1:
            raise ValueError(f"a row of {v} x {x.element_size()} bytes does not fit a slot")
        out = torch.empty(b, self.size * v, dtype=x.dtype) if self.rank == 0 else None
        for a in range(0, b, rows):
            n = min(rows, b - a)
            s = self._begin()
            parts = self._parts(s, x.dtype)[:, :n * v].view(self.size, n, v)
            if out is None:
                parts[self.rank].copy_(x[a:a + n])
                self._post(s)
            else:                                       # rank 0's own part goes straight to the output
                self._post(s)
                dst = out[a:a + n].view(n, self.size, v)
                dst[:, 0].copy_(x[a:a + n])
                self._wait(s, range(1, self.size))
                dst[:, 1:].copy_(parts[1:].transpose(0, 1))
        return out

    def fits_rows(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[1] * x.element_size() <= SLOT_BYTES

    # ---- flags -----------------------------------------------------------------------------------------------
    def _parts(self, s: int, dtype: torch.dtype) -> torch.Tensor:
        key = (s % 2, dtype)
        if key not in self._typed:
            self._typed[key] = self._slots[s % 2].view(dtype)           # [size, SLOT_BYTES / itemsize]
        return self._typed[key]

    def _begin(self) -> int:
        """The next op's number, once its slots are free (every rank past op s - 2, see the invariant)."""
        self._seq += 1
        self._wait(self._seq - 1, range(self.size))
        return self._seq

    def _post(self, s: int) -> None:
        self._flags[self.rank * _LINE] = s

    def _wait(self, s: int, ranks) -> None:
        flags = self._flags
        for r in ranks:
            if flags[r * _LINE] < s:
                self._wait_slow(r, s)
        self.stats.waits += 1

    def _wait_slow(self, r: int, s: int) -> None:
        """Spin, then yield, then sleep (WaitPolicy); a peer that died or never posts raises RuntimeError
        (what gloo raises, so the callers' handling is the same)."""
        flags, p, st, i = self._flags, self.policy, self.stats, r * _LINE
        for _ in range(p.spins):
            if flags[i] >= s:
                st.spun += 1
                return
        start = time.perf_counter()
        while time.perf_counter() - start < p.yield_s:
            os.sched_yield()
            if flags[i] >= s:
                st.yielded += 1
                st.wait_s += time.perf_counter() - start
                return
        checked = time.perf_counter()
        while flags[i] < s:
            time.sleep(p.sleep_s)
            t = time.perf_counter()
            if t - checked > p.check_s:
                checked = t
                if self._pids and not runtime_files.alive(self._pids[r]):
                    raise RuntimeError(f"tp rank {r} died (shared-memory all-reduce)")
                if t - start > p.timeout_s:
                    raise RuntimeError(f"tp rank {r} posted nothing for {p.timeout_s:.0f} s")
        st.slept += 1
        st.wait_s += time.perf_counter() - start

    def close(self) -> None:
        self._typed.clear()
        self._slots = None
        self._flags.release()
        try:
            self._map.close()
        except BufferError:          # a tensor view still alive: the mapping goes with the process
            pass
