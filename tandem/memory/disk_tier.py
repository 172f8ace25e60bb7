"""DiskTier: the prefix cache's second level, on disk, owned by the KVCacheManager (the scheduler's side).

What it keeps: every chunk of CHUNK_TOKENS tokens whose KV enters the radix cache is written once to a file
(memory/disk_format.py; a chain key per chunk), so a prefix that later falls out of RAM, or out of the server with a
restart, is read back instead of recomputed. Write-through rather than write-on-evict: the KV of an evicted node is
already on disk, and a restart (or SIGKILL) loses nothing the writer had finished.

Who does what:
- This index decides what is written and read: `save` queues a chunk's slots, `restore` finds the chunks past a
  RAM hit and reads and checks each file (crc32) before the request is admitted with them, so a bad file costs a
  recompute, never a wrong token. `take_ops` gives the copies the next launched step makes (StepInput.kv_saves /
  kv_loads); the device side (device/kv_disk.py) copies the slots before that step's forward and writes the files
  from a thread of its own, off the step's path.
- When a save may ride: only in a step launched after the step that writes its KV (`save(..., written=False)`
  holds it back one launch: cache_prefill shares a chunk's KV when the step that writes it is picked). Never later
  than the next launch: a slot evicted from the tree may be handed out in that pick, and the step that writes it
  copies the old KV out first (saves before loads before the forward); an urgent step, which runs inside the step
  in flight, could write it first, so an eviction drops the queued saves of its slots (forget_slots). Saves past
  a step's room are dropped.
- The size cap: the LRU of whole files within `capacity` bytes; entries queued but not yet seen on disk count with
  their expected size. The folder: ROOT/<fingerprint>/s<N>, N the first one no live server holds (an flock), so two
  servers on one ROOT never write into each other's files, and a restarted one takes its old folder back.
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .disk_format import (CHUNK_TOKENS, SUFFIX, BadEntry, chain_keys, entry_path, key_words, read_entry,
                          words_key)

log = logging.getLogger("tandem.disk_tier")

PENDING_GRACE_S = 60.0      # a queued write not on disk after this long is taken as lost (a full disk, a drop)
SWEEP_S = 0.25              # the shortest time between two sweeps of the queued writes
_EMPTY = np.zeros(0, np.int64)
MAX_FOLDERS = 64            # servers that may share one root (each takes a folder of its own)


@dataclass
class DiskStats:
    hits: int = 0               # prompt tokens restored from disk
    misses: int = 0             # lookups that found no entry past the RAM hit
    bytes_written: int = 0      # of entries seen on disk after their write
    bytes_read: int = 0         # of entries read back (checked) for a restore
    restore_s: float = 0.0      # seconds spent reading and checking entries
    dropped: int = 0            # chunks not written: no room in the step, or the tier disabled
    bad: int = 0                # entries dropped as missing, truncated, corrupt or foreign
    evicted: int = 0            # entries removed to stay within the size


@dataclass
class _Ops:
    saves: list[int] = field(default_factory=list)      # per chunk: key words (2), then CHUNK_TOKENS slots
    loads: list[int] = field(default_factory=list)      # per chunk: key words (2), skip, n, then n slots


class DiskTier:
    def __init__(self, root: str, capacity: int, fingerprint: str, slot_bytes: int = 0,
                 max_op_tokens: int = 1 << 20) -> None:
        self.fingerprint, self.capacity = fingerprint, capacity
        self.entry_bytes = 4096 + CHUNK_TOKENS * slot_bytes     # a file's expected size (header room included)
        self.max_op_tokens = max_op_tokens       # tokens of saves (and of loads) one step may carry
        self.folder, self._lock_fd = _take_folder(os.path.join(root, fingerprint))
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()   # key -> bytes, LRU first
        self.pending: dict[bytes, float] = {}   # queued, not yet seen on disk: key -> when
        self.used = 0
        self.stats = DiskStats()
        self.enabled = True
        self._now, self._next = _Ops(), _Ops()  # ride the next launch / the one after
        self._loading = 0                       # tokens of loads in self._now
        self._launches = 0
        self._pins: dict[bytes, int] = {}       # key -> the launch after which its load has surely run
        self._swept = -SWEEP_S
        self._scan()

    def set_slot_bytes(self, slot_bytes: int) -> None:
        self.entry_bytes = 4096 + CHUNK_TOKENS * slot_bytes

    # ---- the folder ----------------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index what an earlier run left (oldest first by mtime); remove its unfinished writes."""
        found = []
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if name.endswith(".tmp"):
                _unlink(path)
            elif name.endswith(SUFFIX) and len(name) == 32 + len(SUFFIX):
                try:
                    st = os.stat(path)
                    found.append((st.st_mtime, bytes.fromhex(name[:32]), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used += size
        self._fit(0)
        if found:
            log.info("disk tier: %d entries (%.1f MiB) in %s", len(self.index), self.used / 2**20, self.folder)

    def _fit(self, extra: int) -> None:
        """Remove least recently used entries until `extra` more bytes fit within the capacity. Not one a load in
        flight reads (pinned until two more launches: under the overlap loop the step that carries it is done by
        then), nor a queued write (its file would land after the removal, unindexed)."""
        need = self.used + extra - self.capacity
        if need > 0 and self.pending:
            self.sweep(force=True)                # landed writes become evictable
            need = self.used + extra - self.capacity
        victims = []
        for key, size in self.index.items():
            if need <= 0:
                break
            if key in self.pending or self._pins.get(key, -1) >= self._launches:
                continue
            victims.append(key)
            need -= size
        for key in victims:
            self._drop(key)
            self.stats.evicted += 1

    def _drop(self, key: bytes) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.used -= size
            self.pending.pop(key, None)
            _unlink(entry_path(self.folder, key))

    # ---- writes --------------------------------------------------------------------------------------------
    def save(self, ids: list[int], slots: list[int], written: bool = True) -> None:
        """Queue the whole chunks of ids (with their KV slots) that are not on disk yet. written: the step that
        writes their KV has been launched (else they ride one launch later)."""
        if not self.enabled:
            return
        n = min(len(ids), len(slots)) // CHUNK_TOKENS
        ops = self._now if written else self._next
        for j, key in enumerate(chain_keys(ids, n, self.fingerprint)):
            if key in self.index:
                self.index.move_to_end(key)
                continue
            if (len(ops.saves) // (2 + CHUNK_TOKENS) + 1) * CHUNK_TOKENS > self.max_op_tokens or \
                    self.entry_bytes > self.capacity:
                self.stats.dropped += 1
                continue
            self._fit(self.entry_bytes)
            self.index[key] = self.entry_bytes
            self.used += self.entry_bytes
            self.pending[key] = time.monotonic()
            ops.saves.extend(key_words(key))
            ops.saves.extend(slots[j * CHUNK_TOKENS:(j + 1) * CHUNK_TOKENS])

    def take_idle_saves(self) -> np.ndarray:
        """Every queued save, for an idle engine (no step in flight: each one's KV is written, none waits for a
        launch that may not come soon). No loads are queued then: they ride the step their pick makes."""
        if not (self._now.saves or self._next.saves):
            return _EMPTY
        saves = self._now.saves + self._next.saves
        self._now.saves, self._next.saves = [], []
        return np.array(saves, np.int64)

    def forget_slots(self, freed: list[int]) -> None:
        """Slots the RAM cache evicted: a queued save that copies one of them is dropped (and unindexed). Safe to
        keep where the step that reuses the slot carries the save (it copies before its forward), but not where an
        urgent step, run inside the step in flight, gets the slot first."""
        if not freed or not (self._now.saves or self._next.saves):
            return
        gone = set(freed)
        w = 2 + CHUNK_TOKENS
        for ops in (self._now, self._next):
            keep = []
            for i in range(0, len(ops.saves), w):
                e = ops.saves[i:i + w]
                if gone.isdisjoint(e[2:]):
                    keep.extend(e)
                    continue
                key = words_key(e[0], e[1])
                self.stats.dropped += 1
                size = self.index.pop(key, None)
                if size is not None:
                    self.used -= size
                self.pending.pop(key, None)
            ops.saves = keep

    def take_ops(self) -> tuple[np.ndarray, np.ndarray]:
        """The saves and loads the step launched now carries; the held-back saves become the next launch's."""
        now, self._now, self._next = self._now, self._next, _Ops()
        self._loading = 0
        self._launches += 1
        if self._pins:
            self._pins = {k: v for k, v in self._pins.items() if v >= self._launches}
        return np.array(now.saves, np.int64), np.array(now.loads, np.int64)

    def disable(self, why: str) -> None:
        if self.enabled:
            log.warning("disk tier disabled: %s; the server goes on without it", why)
        self.enabled = False

    # ---- reads ---------------------------------------------------------------------------------------------
    def restorable(self, ids: list[int], start: int) -> list[tuple[bytes, int, int]]:
        """The entries that extend a cached prefix of `start` tokens of ids, as (key, skip, n): chunk after chunk
        from the one holding token `start`, while on disk and valid (each file read and checked here), within the
        step's room. Their tokens [start, start + sum n)."""
        n_chunks = len(ids) // CHUNK_TOKENS
        first = start // CHUNK_TOKENS
        if first >= n_chunks or not self.index:
            return []
        keys = chain_keys(ids, n_chunks, self.fingerprint)
        out, pos, t0 = [], start, time.perf_counter()
        for j in range(first, n_chunks):
            key = keys[j]
            room = self.max_op_tokens - self._loading - (pos - start)
            if key not in self.index or room < CHUNK_TOKENS or not self._check(key):
                break
            end = (j + 1) * CHUNK_TOKENS
            out.append((key, pos - j * CHUNK_TOKENS, end - pos))
            pos = end
        self.stats.restore_s += time.perf_counter() - t0
        if out:
            self.stats.hits += pos - start
        else:
            self.stats.misses += 1
        return out

    def _check(self, key: bytes) -> bool:
        """Is key's file on disk and valid? A queued write not there yet is only a miss for now."""
        path = entry_path(self.folder, key)
        try:
            payload = read_entry(path, key, self.fingerprint)
        except BadEntry as e:
            queued = self.pending.get(key)
            if str(e) == "missing" and queued is not None and time.monotonic() - queued < PENDING_GRACE_S:
                return False
            if str(e) != "missing":
                log.warning("disk tier: dropped %s: %s; its prefix is recomputed", os.path.basename(path), e)
            self.stats.bad += 1
            self._drop(key)
            return False
        self._confirm(key, path)
        self.stats.bytes_read += len(payload)
        self.index.move_to_end(key)
        return True

    def _confirm(self, key: bytes, path: str) -> None:
        """A queued entry is on disk: its real size replaces the expected one."""
        if self.pending.pop(key, None) is None:
            return
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        self.used += size - self.index[key]
        self.index[key] = size
        self.stats.bytes_written += size

    def load(self, entries: list[tuple[bytes, int, int]], slots: list[int]) -> None:
        """Queue the loads of entries (restorable's) into slots (one a token, in order), for the next launch."""
        i = 0
        for key, skip, n in entries:
            self._now.loads.extend((*key_words(key), skip, n))
            self._now.loads.extend(slots[i:i + n])
            self._pins[key] = self._launches + 2
            i += n
        self._loading += i

    def sweep(self, force: bool = False) -> None:
        """Confirm queued writes that have landed (the metrics' bytes written; sizes), drop the long lost. At most
        every SWEEP_S: the engine's stats are asked for often."""
        t = time.monotonic()
        if t - self._swept < SWEEP_S and not force:
            return
        self._swept = t
        for key, queued in list(self.pending.items()):
            path = entry_path(self.folder, key)
            if os.path.exists(path):
                self._confirm(key, path)
            elif t - queued > PENDING_GRACE_S:
                self.stats.dropped += 1
                self._drop(key)

    def as_stats(self) -> dict:
        self.sweep()
        s = self.stats
        return {"disk_hits": s.hits, "disk_misses": s.misses, "disk_bytes_written": s.bytes_written,
                "disk_bytes_read": s.bytes_read, "disk_restore_seconds": s.restore_s, "disk_entries": len(self.index),
                "disk_bytes": self.used, "disk_pending": len(self.pending), "disk_dropped": s.dropped, "disk_bad_entries": s.bad,
                "disk_evicted": s.evicted, "disk_enabled": int(self.enabled)}

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def open_disk_tier(config, source, model_config, name: str) -> DiskTier | None:
    """The engine's disk tier (config.kv_disk_dir), keyed by its fingerprint; None where it is off."""
    if config.kv_disk_dir is None:
        return None
    if model_config.linear_layers:
        raise ValueError(f"kv_disk_dir: {name} is a hybrid linear-attention model ({model_config.architecture}); "
                         f"the disk tier does not write its state checkpoints yet, so it would never restore a "
                         f"prefix of it: serve it without kv_disk_dir")
    from ..fingerprint import system_fingerprint
    return DiskTier(config.kv_disk_dir, parse_size(config.kv_disk_size),
                    system_fingerprint(config, source.weight_files))


def _take_folder(base: str) -> tuple[str, int]:
    """The first folder s<N> under base that no live server holds, with its lock held for this process's life."""
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_disk_dir: cannot make the disk tier's folder {base}: {e}") from None
    for n in range(MAX_FOLDERS):
        folder = os.path.join(base, f"s{n}")
        fd = os.open(folder + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        os.makedirs(folder, exist_ok=True)
        return folder, fd
    raise RuntimeError(f"kv_disk_dir: {MAX_FOLDERS} servers already hold folders under {base}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def parse_size(text: str) -> int:
    """'20GiB', '500MB', '1.5G', '4096' (bytes) -> bytes."""
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"kv_disk_size must be a size such as 20GiB, 500MB or 1073741824, got {text!r}")
    return int(value * units[unit])
