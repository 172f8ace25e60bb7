"""The tensor-parallel group: the device ranks of one engine joined by torch.distributed (gloo on CPU, NCCL
on CUDA: the same calls).

Rank 0 is the device process the scheduler launches into; it broadcasts every step (the StepInput words it
read from shared memory) to the other ranks, which run the same forward on their weight shards. Collectives
in the forward: one all-reduce after each row-parallel layer (o, down) and after the vocab-parallel
embedding, and a gather of the LM head's vocab shards on rank 0, which alone samples (penalties, grammar
masks, logprobs stay there). The other ranks learn the sampled ids with the next step's broadcast and
stash them into their own FutureMap before that step gathers from it, so every rank's FutureMap holds what
rank 0's does when a step reads it.

An idle rank 0 sends a no-op every step_wire.KEEPALIVE_S, so the other ranks' collective timeout (TIMEOUT_S) only
fires for a peer that is stuck or unreachable; a peer that dies closes its connections and the next
collective fails at once (DeviceProcessError on the scheduler's side, never a hang).

Ranks on one host run the all-reduces and the logits gather through shared memory (device/parallel/shm_collectives.py,
15-30x cheaper a call than gloo over loopback); the step broadcast stays on gloo, whose receive blocks an idle rank
without spinning. tp_comm "gloo" keeps every collective on gloo.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from . import step_wire
from ..ranks import DistInfo, init_group
from .shm_collectives import ShmComm
from ...model.row_parallel import add_in_order
from ..step import StepInput

log = logging.getLogger(__name__)

TIMEOUT_S = 600.0         # rendezvous of all ranks, and any single collective


class TPGroup(step_wire.WireControl):
    def __init__(self, info: DistInfo, device: torch.device) -> None:
        backend = init_group(info, device, TIMEOUT_S)
        self.rank, self.size, self.device = info.rank, info.size, device
        self.shm = ShmComm.join(info.rank, info.size, info.comm == "auto") if backend == "gloo" else None
        self.transport = "shm" if self.shm is not None else backend    # of the forward's collectives
        if info.rank == 0:
            log.info("tp %d: the forward's collectives over %s", info.size, self.transport)
        self.comm_s = 0.0         # seconds in collectives since reset (rank 0 reports it per step)
        self._prev: tuple[np.ndarray, np.ndarray] | None = None   # rank 0: the last step's rows and ids

    # ---- collectives of the forward -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> None:
        t = time.perf_counter()
        if self.shm is not None:
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x)
        self.comm_s += time.perf_counter() - t

    def all_reduce_in_order(self, parts: torch.Tensor) -> torch.Tensor:
        """[c, M, N] partials of this rank's chunks -> [M, N]: all ranks' partials added in chunk order
        (model/row_parallel.py), the same bits on every rank and at every tp size."""
        t = time.perf_counter()
        c, shape = parts.shape[0], parts.shape[1:]
        flat = parts.reshape(c, -1)
        out = torch.empty(flat.shape[1], dtype=parts.dtype, device=parts.device)
        if self.shm is not None:
            self.shm.all_reduce_in_order(flat, out)
        else:
            every = [torch.empty_like(flat) for _ in range(self.size)]
            dist.all_gather(every, flat.contiguous())
            add_in_order([p for part in every for p in part], out)
        self.comm_s += time.perf_counter() - t
        return out.view(shape)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[B, Vp] shards -> [B, size * Vp] on rank 0 (None elsewhere)."""
        t = time.perf_counter()
        if self.shm is not None and self.shm.fits_rows(x):
            full = self.shm.gather_rows(x)
            self.comm_s += time.perf_counter() - t
            return full
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self.comm_s += time.perf_counter() - t
        return torch.cat(parts, dim=1) if parts is not None else None

    def probe(self) -> None:
        """Rank 0, idle, on the executor's liveness probe: a round trip through every rank (a PROBE message, then
        an all-reduce each of them joins in recv_step), so it returns only once all of them answered: a stopped or
        stuck rank > 0 blocks it as a stopped rank 0 would, and /health sees the silence."""
        self._send(step_wire.PROBE)
        self.min_int(0)

    def min_int(self, v: int) -> int:
        t = torch.tensor([v], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- the step broadcast (rank 0 sends, the others receive) ----------------------------------------------
    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.broadcast(t, src=0)
        self.comm_s += time.perf_counter() - start
        return t

    def _send(self, kind: int, step_id: int = 0, payload: np.ndarray | None = None, words=(0, 0, 0)) -> None:
        step_wire.send_words(self._bcast, self.device, kind, step_id, payload, words)

    def send_step(self, step_id: int, step: StepInput, ints: np.ndarray, floats: np.ndarray) -> None:
        """Rank 0, before its forward: the step's packed words and the previous step's sampled ids."""
        self.comm_s = 0.0
        rows, ids = self._prev if self._prev is not None else (np.zeros(0, np.int64),) * 2
        self._prev = None
        payload, words = step_wire.step_payload(step, ints, floats, np.concatenate([rows, ids]))
        self._send(step_wire.STEP, step_id, payload, words)

    def sampled(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Rank 0, after sampling: what the other ranks stash into their FutureMap next step."""
        self._prev = (rows.cpu().numpy().astype(np.int64), ids.cpu().numpy().astype(np.int64))

    def _control(self, kind: int) -> None:            # keepalive() and quit() (step_wire.WireControl)
        self._send(kind)

    def recv_step(self) -> tuple[StepInput, torch.Tensor, torch.Tensor] | None:
        """Ranks 1..: the next step and the previous step's (rows, ids); None when rank 0 quits."""
        while True:
            kind, _, step, _, _, extra = step_wire.recv_words(self._bcast, self.device)
            if kind == step_wire.QUIT:
                return None
            if kind == step_wire.STEP:
                break
            if kind == step_wire.PROBE:
                self.min_int(0)             # rank 0's liveness round trip (probe)
        prev = torch.from_numpy(extra.copy()).to(self.device).view(2, len(extra) // 2)
        return step, prev[0], prev[1]

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()
