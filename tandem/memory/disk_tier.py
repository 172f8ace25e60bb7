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
- A hybrid's state entries: each state checkpoint the prefix cache saves is written with the KV of its tail past
  the last whole chunk (`save_state`), and a request resumes from the deepest one past its RAM checkpoint
  (`restorable_state`), its KV chunks read with it.
- The size cap: the LRU of whole files within `capacity` bytes; entries queued but not yet seen on disk count with
  their expected size. The folder: ROOT/<fingerprint>/s<N>, N the first one no live server holds (an flock), so two
  servers on one ROOT never write into each other's files, and a restarted one takes its old folder back.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .disk_folder import take_folder, unlink
from .disk_format import (CHUNK_TOKENS, STATE_SUFFIX, SUFFIX, BadEntry, chain_keys, entry_path, key_words,
                          read_entry, read_header, root_key, state_key, words_key)

log = logging.getLogger("tandem.disk_tier")

PENDING_GRACE_S = 60.0      # a queued write not on disk after this long is taken as lost (a full disk, a drop)
SWEEP_S = 0.25              # the shortest time between two sweeps of the queued writes
_EMPTY = np.zeros(0, np.int64)


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
    # a hybrid's state entries: key words, checkpoint id, tail, parent key words, then the tail's slots (saves);
    # key words, checkpoint id, tail, then the tail's slots (loads)
    state_saves: list[int] = field(default_factory=list)
    state_loads: list[int] = field(default_factory=list)
    copying: list[int] = field(default_factory=list)    # state saves whose checkpoint copy is not yet launched


class DiskTier:
    def __init__(self, root: str, capacity: int, fingerprint: str, slot_bytes: int = 0,
                 max_op_tokens: int = 1 << 20) -> None:
        self.fingerprint, self.capacity = fingerprint, capacity
        self.entry_bytes = 4096 + CHUNK_TOKENS * slot_bytes     # a file's expected size (header room included)
        self.max_op_tokens = max_op_tokens       # tokens of saves (and of loads) one step may carry
        self.folder, self._lock_fd = take_folder(os.path.join(root, fingerprint))
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
        self._last_landed = time.monotonic()    # when a queued write was last seen on disk
        self.state_bytes = 0                    # a hybrid's state of one request (KVCacheManager sets it)
        self.states: dict[bytes, dict[int, bytes]] = {}  # parent chunk key -> tail -> state entry key
        self.state_of: dict[bytes, tuple[bytes, int]] = {}   # state entry key -> (parent, tail)
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
                unlink(path)
            elif name.endswith((SUFFIX, STATE_SUFFIX)) and len(name) == 35:
                try:
                    st = os.stat(path)
                    key = bytes.fromhex(name[:32])
                except (OSError, ValueError):
                    continue
                if name.endswith(STATE_SUFFIX):
                    h = read_header(path)
                    if not h or not isinstance(h.get("parent"), str) or not isinstance(h.get("tail"), int):
                        unlink(path)
                        continue
                    self._index_state(key, bytes.fromhex(h["parent"]), h["tail"])
                found.append((st.st_mtime, key, st.st_size))
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

    def _path(self, key: bytes) -> str:
        return entry_path(self.folder, key, STATE_SUFFIX if key in self.state_of else SUFFIX)

    def _index_state(self, key: bytes, parent: bytes, tail: int) -> None:
        self.states.setdefault(parent, {})[tail] = key
        self.state_of[key] = (parent, tail)

    def _drop(self, key: bytes, remove: bool = True) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.used -= size
            self.pending.pop(key, None)
            if remove:
                unlink(self._path(key))
        if key in self.state_of:
            parent, tail = self.state_of.pop(key)
            self.states.get(parent, {}).pop(tail, None)

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

    # ---- a hybrid model's state entries ---------------------------------------------------------------------
    def save_state(self, ids: list[int], tail_slots: list[int], cid: int, after_step: bool) -> None:
        """Queue the entry of the state after ids (checkpoint cid) and the KV of ids' tail past its last whole chunk
        (tail_slots). The checkpoint copy rides the step being picked (after_step: after its forward) or the next
        launch: this rides the launch after either."""
        n = len(ids) // CHUNK_TOKENS
        parent = chain_keys(ids, n, self.fingerprint)[-1] if n else root_key(self.fingerprint)
        tail = ids[n * CHUNK_TOKENS:]
        key = state_key(parent, tail)
        size = 4096 + len(tail) * self.entry_bytes // CHUNK_TOKENS + self.state_bytes
        if key in self.index:
            self.index.move_to_end(key)
            return
        if not self.enabled or size > self.capacity:
            self.stats.dropped += 1
            return
        self._fit(size)
        self.index[key], self.used, self.pending[key] = size, self.used + size, time.monotonic()
        self._index_state(key, parent, len(tail))
        op = [*key_words(key), cid, len(tail), *key_words(parent), *tail_slots]
        (self._next.state_saves if after_step else self._next.copying).extend(op)

    def restorable_state(self, ids: list[int], start: int):
        """The deepest state entry past `start` on ids' path whose KV the disk holds from `start` on: (the KV
        entries, as restorable's, to the state's chunk; (key, tail, depth)), or None."""
        n_chunks = len(ids) // CHUNK_TOKENS
        if not self.states:
            return None
        keys = chain_keys(ids, n_chunks, self.fingerprint)
        t0 = time.perf_counter()
        try:
            for j in range(n_chunks, start // CHUNK_TOKENS - 1, -1):
                parent = keys[j - 1] if j else root_key(self.fingerprint)
                for tail, key in sorted(self.states.get(parent, {}).items(), reverse=True):
                    depth = j * CHUNK_TOKENS + tail
                    if depth <= start or depth > len(ids) or depth - start > self.max_op_tokens - self._loading \
                            or key != state_key(parent, ids[j * CHUNK_TOKENS:depth]):
                        continue
                    kv = self._run(ids, keys, start, j) if j * CHUNK_TOKENS > start else []
                    if kv is not None and self._check(key):
                        self.stats.hits += depth - start
                        return kv, (key, tail, depth)
            self.stats.misses += 1
            return None
        finally:
            self.stats.restore_s += time.perf_counter() - t0

    def _run(self, ids: list[int], keys: list[bytes], start: int, end_chunk: int):
        """The KV entries of [start, end_chunk chunks) when every one is on disk and valid, else None."""
        out, pos = [], start
        for j in range(start // CHUNK_TOKENS, end_chunk):
            if keys[j] not in self.index or not self._check(keys[j]):
                return None
            out.append((keys[j], pos - j * CHUNK_TOKENS, (j + 1) * CHUNK_TOKENS - pos))
            pos = (j + 1) * CHUNK_TOKENS
        return out

    def load_state(self, key: bytes, tail: int, cid: int, slots: list[int]) -> None:
        """Queue the load of a state entry into checkpoint cid and its tail's KV into slots, for the next launch."""
        self._now.state_loads.extend((*key_words(key), cid, tail, *slots))
        self._pins[key] = self._launches + 2
        self._loading += tail

    def take_idle_saves(self) -> tuple[np.ndarray, np.ndarray]:
        """The queued saves an idle engine sends at once (no step in flight: their KV is written, and the checkpoint
        copies still queued go first in the same message), as (saves, state saves). No loads are queued then:
        they ride the step their pick makes."""
        saves = self._now.saves + self._next.saves
        states = self._now.state_saves + self._next.state_saves + self._now.copying + self._next.copying
        for ops in (self._now, self._next):
            ops.saves, ops.state_saves, ops.copying = [], [], []
        return np.array(saves, np.int64), np.array(states, np.int64)

    def forget_slots(self, freed: list[int]) -> None:
        """Slots the RAM cache evicted: a queued save that copies one of them is dropped (and unindexed). Safe to
        keep where the step that reuses the slot carries the save (it copies before its forward), but not where an
        urgent step, run inside the step in flight, gets the slot first."""
        if freed:
            gone = set(freed)
            self._forget(lambda kind, e: not gone.isdisjoint(e[2:] if kind == "saves" else e[6:]))

    def forget_cid(self, cid: int) -> None:
        """A checkpoint id handed out again: the queued state saves that copy it are dropped (as forget_slots)."""
        self._forget(lambda kind, e: kind != "saves" and e[2] == cid)

    def _forget(self, hit) -> None:
        for ops in (self._now, self._next):
            for kind in ("saves", "state_saves", "copying"):
                queued, keep, i = getattr(ops, kind), [], 0
                while i < len(queued):
                    w = 2 + CHUNK_TOKENS if kind == "saves" else 6 + queued[i + 3]
                    e = queued[i:i + w]
                    i += w
                    if not hit(kind, e):
                        keep.extend(e)
                        continue
                    self.stats.dropped += 1
                    self._drop(words_key(e[0], e[1]), remove=False)
                setattr(ops, kind, keep)

    def take_ops(self) -> tuple[np.ndarray, ...]:
        """The saves, loads, state saves and state loads the step launched now carries; the held-back ones become
        the next launch's."""
        now, self._now, self._next = self._now, self._next, _Ops()
        self._now.state_saves += self._now.copying      # their checkpoint copies ride this launch: safe after it
        self._now.copying = []
        self._loading = 0
        self._launches += 1
        if self._pins:
            self._pins = {k: v for k, v in self._pins.items() if v >= self._launches}
        return tuple(np.array(getattr(now, f), np.int64) for f in ("saves", "loads", "state_saves", "state_loads"))

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
            room = self.max_op_tokens - self._loading - (pos - start)   # the step's room for copies
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
        path = self._path(key)
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
        self._last_landed = time.monotonic()

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
            path = self._path(key)
            if os.path.exists(path):
                self._confirm(key, path)
            elif t - queued > PENDING_GRACE_S:
                self.stats.dropped += 1
                self._drop(key)
                if t - self._last_landed > PENDING_GRACE_S:       # not a save the writer's full queue dropped
                    self.disable(f"no queued write has landed for {PENDING_GRACE_S:.0f} s (a full disk or a write "
                                 f"error: the log says which)")

    def as_stats(self) -> dict:
        self.sweep()
        s = self.stats
        return {"disk_hits": s.hits, "disk_misses": s.misses, "disk_bytes_written": s.bytes_written,
                "disk_bytes_read": s.bytes_read, "disk_restore_seconds": s.restore_s, "disk_entries": len(self.index),
                "disk_bytes": self.used, "disk_pending": len(self.pending), "disk_dropped": s.dropped,
                "disk_bad_entries": s.bad,
                "disk_evicted": s.evicted, "disk_enabled": int(self.enabled)}

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
