"""The disk tier's device side (memory/disk_tier.py has the index and the rules): a step's KV saves and loads,
run by the model runner before its forward, saves first (a slot the step's loads or rows write may be one an
evicted entry still holds), and the files written by a thread of this process, off the step's path.

A save copies its chunk's slots out of every KV tensor (one index_select each) and hands the bytes to the writer;
a load reads the entry's file (checked by the scheduler a moment before: here its header only) and writes the
tokens [skip, skip + n) of it into n slots. A write that fails (a full disk, a read-only folder) disables the
writes with a warning; the server goes on, the index sees the files never came (DiskTier.sweep).
"""
from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import torch

from ..memory.disk_format import (CHUNK_TOKENS, STATE_SUFFIX, BadEntry, entry_path, load_entries, read_entry,
                                  words_key, write_entry)

log = logging.getLogger("tandem.disk_tier")

MAX_QUEUED_BYTES = 512 << 20     # copies waiting for the writer; past it a save is dropped (the disk is too slow)


def join_words(*arrays: np.ndarray) -> np.ndarray:
    """int64 arrays as one: each one's length, then its words (an idle engine's saves in one message)."""
    parts = [np.array([len(a)], np.int64) for a in arrays]
    return np.concatenate([x for p, a in zip(parts, arrays) for x in (p, np.asarray(a, np.int64))])


def split_words(words: np.ndarray, n: int) -> list[np.ndarray]:
    out, o = [], 0
    for _ in range(n):
        k = int(words[o])
        out.append(words[o + 1:o + 1 + k])
        o += 1 + k
    return out


class DiskKV:
    def __init__(self, folder: str, fingerprint: str, tensors: list[torch.Tensor],
                 states: tuple[torch.Tensor, ...] = ()) -> None:
        self.folder, self.fingerprint, self.tensors = folder, fingerprint, tensors
        self.states = states        # a hybrid's checkpoint pool (RecurrentState.saved_conv, saved_ssm): [L, ids, ...]
        self.row_bytes = [t[0].numel() * t.element_size() for t in tensors]    # one slot's bytes in each
        self.failed: str | None = None
        self._queue: queue.Queue = queue.Queue()
        self._queued = 0
        self._full_said = False             # the writer's queue was full and the log said so
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- the step's ops ------------------------------------------------------------------------------------
    def run(self, saves: np.ndarray, state_saves: np.ndarray, loads: np.ndarray = None,
            state_loads: np.ndarray = None) -> None:
        """A step's copies, before its forward and its checkpoint copies: saves first (a slot or checkpoint they
        copy may be one the loads or the step write), then loads."""
        for ops, do in ((saves, self.save), (state_saves, self.save_states), (loads, self.load),
                        (state_loads, self.load_states)):
            if ops is not None and len(ops):
                do(ops)

    def save(self, ops: np.ndarray) -> None:
        """ops: per chunk, its key's two words and CHUNK_TOKENS slots."""
        if self.failed is not None:
            return
        w = 2 + CHUNK_TOKENS
        for e in ops.reshape(-1, w):
            slots = torch.from_numpy(e[2:].copy())
            payload = b"".join(t.index_select(0, slots).contiguous().view(torch.uint8).numpy().tobytes()
                               for t in self.tensors)
            self._put(words_key(int(e[0]), int(e[1])), payload, {})

    def save_states(self, ops: np.ndarray) -> None:
        """ops: per entry, its key's words, checkpoint id, tail, parent key's words, then the tail's slots."""
        i = 0
        while i < len(ops) and self.failed is None:
            cid, tail = int(ops[i + 2]), int(ops[i + 3])
            slots = torch.from_numpy(ops[i + 6:i + 6 + tail].copy())
            parts = [t.index_select(0, slots).contiguous().view(torch.uint8).numpy().tobytes() for t in self.tensors]
            parts += [s[:, cid].contiguous().view(torch.uint8).numpy().tobytes() for s in self.states]
            extra = {"parent": words_key(int(ops[i + 4]), int(ops[i + 5])).hex(), "tail": tail,
                     "suffix": STATE_SUFFIX}
            self._put(words_key(int(ops[i]), int(ops[i + 1])), b"".join(parts), extra)
            i += 6 + tail

    def load_states(self, ops: np.ndarray) -> None:
        """ops: per entry, its key's words, checkpoint id, tail, then the tail's slots."""
        for key, cid, tail, slots in load_entries(ops):
            slots = torch.from_numpy(slots.copy())
            payload = self._read(key, STATE_SUFFIX)
            o = self._rows_in(payload, 0, tail, tail, slots)
            for st in self.states:
                n = st[:, cid].numel() * st.element_size()
                st[:, cid].copy_(torch.frombuffer(bytearray(payload[o:o + n]), dtype=torch.uint8)
                                 .view(st.dtype).view(st[:, cid].shape))
                o += n
            if o != len(payload):
                raise RuntimeError("disk tier state entry of another layout under this engine's fingerprint")

    def _put(self, key: bytes, payload: bytes, extra: dict) -> None:
        with self._lock:
            if self._queued + len(payload) > MAX_QUEUED_BYTES:
                if not self._full_said:
                    log.warning("disk tier: the writer is %d MiB behind; saves are dropped until it catches up",
                                MAX_QUEUED_BYTES >> 20)
                    self._full_said = True
                return
            self._queued += len(payload)
            self._full_said = False
        self._queue.put((key, payload, extra))

    def _read(self, key: bytes, suffix: str) -> memoryview:
        try:
            return read_entry(entry_path(self.folder, key, suffix), key, self.fingerprint, check=False)
        except BadEntry as e:       # the scheduler read it whole a moment ago: only a hand outside can do this
            raise RuntimeError(f"disk tier entry {key.hex()} changed under the server: {e}") from None

    def load(self, ops: np.ndarray) -> None:
        """ops: per chunk, its key's two words, skip, n, then n slots."""
        for key, skip, n, slots in load_entries(ops):
            slots = torch.from_numpy(slots.copy())
            payload = self._read(key, ".kv")
            if len(payload) != CHUNK_TOKENS * sum(self.row_bytes):
                raise RuntimeError("disk tier entry of another KV layout under this engine's fingerprint")
            self._rows_in(payload, skip, n, CHUNK_TOKENS, slots)

    def _rows_in(self, payload: memoryview, skip: int, n: int, rows: int, slots: torch.Tensor) -> int:
        """Tokens [skip, skip + n) of a payload holding `rows` tokens of each KV tensor into slots; returns the
        offset past the KV part."""
        o = 0
        for t, rb in zip(self.tensors, self.row_bytes):
            if n:
                part = payload[o + skip * rb:o + (skip + n) * rb]
                src = torch.frombuffer(bytearray(part), dtype=torch.uint8).view(t.dtype).view(n, *t.shape[1:])
                t.index_copy_(0, slots, src)
            o += rows * rb
        return o

    # ---- the writer ----------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):       # flush(): every write before it has landed
                item.set()
                continue
            key, payload, extra = item
            try:
                if self.failed is None:
                    write_entry(self.folder, key, self.fingerprint, payload, extra.pop("suffix", ".kv"), **extra)
            except OSError as e:
                self.failed = str(e)
                log.warning("disk tier: writing %s failed (%s); no more writes, the server goes on", key.hex(), e)
            finally:
                with self._lock:
                    self._queued -= len(payload)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the queued writes (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
