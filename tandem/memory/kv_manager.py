"""KVCacheManager: the host's bookkeeping of the device's KV memory, owned by the scheduler.

It holds the KV slot free list, the radix prefix cache, the request-table rows and the prefix-cache counters,
and moves slots between them: admission matches a cached prefix, a step allocates slots (evicting cached leaves
only when the free list runs short), and a leaving request's KV goes to the cache or the free list. It never
looks at steps in flight: the scheduler decides *when* memory may be released (Scheduler.finish states why that
is safe under the one-step lag) and calls release then.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from ..request import Req
from .disk_format import CHUNK_TOKENS
from .disk_tier import DiskTier
from .kv_allocator import KVSlotAllocator
from .radix_cache import RadixCache
from .req_table import ReqRowAllocator
from .state_checkpoints import StateCheckpoints


class KVCacheManager:
    def __init__(self, num_slots: int, max_rows: int, prefix_cache: bool,
                 checkpoints: StateCheckpoints | None = None, recurrent: int = 0,
                 disk: DiskTier | None = None) -> None:
        self.kv = KVSlotAllocator(num_slots)
        # The prefix cache's disk tier (disk_tier.py): what enters the tree is written through to it, and a prefix
        # the tree lost is read back at admission (restore_from_disk); a hybrid's with its checkpoints' states.
        self.disk = disk if prefix_cache and (not recurrent or checkpoints is not None) else None
        if self.disk is not None:
            self.disk.state_bytes = recurrent
        # A hybrid model's request also carries a linear-attention state, which a cached prefix's KV does not give
        # back: it resumes from a state checkpoint (state_checkpoints.py), or, with none, from position 0.
        # recurrent: the bytes of that state (0: not a hybrid), for the memory the states take (stats)
        self.recurrent = recurrent
        self.checkpoints = checkpoints if recurrent and prefix_cache else None
        self.cache = RadixCache() if prefix_cache else None
        self.rows = ReqRowAllocator(max_rows)
        self.prefix_queries = 0             # prompt tokens looked up in the prefix cache at admission
        self.prefix_hits = 0                # of those, tokens whose KV the cache held
        self._freed_rows: list[int] = []

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    # ---- admission -----------------------------------------------------------------------------------------
    def match_prefix(self, req: Req) -> int:
        """Admission: point the request at the longest cached prefix of its fill ids and lock it there.
        The last token is always computed: its logits sample the next token. Returns the hit length."""
        req.cached_len, req.state_from = 0, None
        if self.takes_hits(req):
            fill = req.fill_ids()
            if self.recurrent:          # only as deep as a saved state: the first chunk restores it (make_batch)
                slots, node = self.cache.match_checkpointed(fill[:-1])
                req.state_from = node.checkpoint
            else:
                slots, node = self.cache.match_prefix(fill[:-1])
            self.cache.lock(node)
            req.slots, req.cached_len, req.cache_node = slots, len(slots), node
        req.filled = req.cached_len
        return req.cached_len

    def restore_from_disk(self, req: Req) -> int:
        """Admission, after match_prefix: extend the request's cached prefix with the disk tier's chunks past it.
        Their KV goes into new slots now in the tree (locked by the request, as its RAM hit is), and the loads ride
        the step being picked, before its forward: every reader of these slots is that step or a later one (an
        urgent step reads none: its pick does not come here, and its fence holds the loads of the steps in
        flight). Returns the tokens restored (they count as cached: usage's cached_tokens)."""
        if self.disk is None or not self.takes_hits(req):
            return 0
        fill = req.fill_ids()
        if self.checkpoints is not None:
            return self._restore_state(req, fill)
        entries = self.disk.restorable(fill[:-1], req.cached_len)
        n = sum(e[2] for e in entries)
        if not n:
            return 0
        slots = self.alloc_slots(n)
        self.disk.load(entries, slots)
        return self._take_restored(req, fill[:req.cached_len + n], slots)

    def _restore_state(self, req: Req, fill: list[int]) -> int:
        """A hybrid's restore: to the deepest state entry past its RAM checkpoint, the KV to it and the state, which
        goes into a checkpoint id of the restored node (the request resumes from it as from a RAM checkpoint)."""
        found = self.disk.restorable_state(fill[:-1], req.cached_len)
        if found is None:
            return 0
        entries, (key, tail, depth) = found
        cid = self.checkpoints.take(self.cache, None)
        if cid is None:
            return 0
        self.disk.forget_cid(cid)
        n = depth - req.cached_len
        slots = self.alloc_slots(n)
        self.disk.load(entries, slots[:n - tail])
        self.disk.load_state(key, tail, cid, slots[n - tail:])
        restored = self._take_restored(req, fill[:depth], slots)
        self.checkpoints.attach(self.cache, req.cache_node, cid)
        if req.cache_node.checkpoint != cid:        # the tree had a state there after all (attach gave cid back)
            cid = req.cache_node.checkpoint
        req.state_from = cid
        return restored

    def _take_restored(self, req: Req, ids: list[int], slots: list[int]) -> int:
        """Put restored KV (slots for ids[cached_len:]) into the tree and move the request's lock to its end; slots
        of tokens the tree already held are freed (their load is wasted, harmless: no reader). Returns the tokens
        restored past the request's old cached prefix."""
        start = req.cached_len
        held = self.cache.insert(ids, req.slots[:start] + slots)
        if held > start:
            self.kv.free(slots[:held - start])
        tree_slots, node = self.cache.match_prefix(ids)
        self.cache.lock(node)
        self.cache.unlock(req.cache_node)
        req.slots, req.cached_len, req.cache_node = tree_slots, len(tree_slots), node
        req.filled = req.cached_len
        return len(ids) - start

    def flush_disk_saves(self, executor) -> None:
        """The engine is idle (no step in flight): the saves still queued go to the device now."""
        if self.disk is not None:
            saves, states = self.disk.take_idle_saves()
            if len(saves) or len(states):
                # a hybrid's checkpoint copies of released rows go first: their state entries copy those
                ops = self.take_state_ops()
                executor.save_kv(saves, states, ops if ops is not None else np.zeros(0, np.int64))

    def take_disk_ops(self):
        """The disk tier's saves, loads, state saves and state loads the ordinary step launched now carries
        (StepInput.kv_saves, kv_loads, kv_state_saves, kv_state_loads), or None without a tier."""
        return None if self.disk is None else self.disk.take_ops()

    def takes_hits(self, req: Req) -> bool:
        """Whether the request may start from a cached prefix: not with prompt logprobs or mean pooling, which
        need every prompt position computed (their KV still goes into the cache as anyone's)."""
        return (self.cache is not None and (self.checkpoints is not None or not self.recurrent)
                and req.params.prompt_logprobs is None and req.params.pooling != "mean")

    def unmatch(self, req: Req) -> None:
        """Undo match_prefix for a request that was not admitted after all."""
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.slots, req.cached_len, req.cache_node, req.filled, req.state_from = [], 0, None, 0, None

    def admit(self, req: Req, n: int, cached: int) -> None:
        """Give an admitted request its n uncached slots and count its prefix lookup."""
        req.slots = req.slots + self.alloc_slots(n)
        self.prefix_queries += len(req.fill_ids())
        self.prefix_hits += cached

    # ---- slots ---------------------------------------------------------------------------------------------
    def alloc_slots(self, n: int) -> list[int]:
        """n free KV slots, evicting unlocked prefix-cache leaves (LRU) only when the free list runs short."""
        short = n - self.kv.available()
        if short > 0 and self.cache is not None:
            freed = self.cache.evict(short)
            if self.disk is not None:
                self.disk.forget_slots(freed)
            self.kv.free(freed)
        return self.kv.alloc(n)

    def free_slots(self, slots: list[int]) -> None:
        self.kv.free(slots)

    def available(self) -> int:
        """KV slots a step may get: free, plus cached but unlocked (evictable on demand)."""
        return self.kv.available() + (self.cache.evictable_size if self.cache is not None else 0)

    def reset_prefix_cache(self) -> None:
        """Free every unlocked cached prefix (vLLM's reset_prefix_cache): a benchmark that repeats one workload
        measures each round's prefill cold, not the previous round's cache hits."""
        if self.cache is not None:
            freed = self.cache.evict(self.cache.evictable_size)
            if self.disk is not None:
                self.disk.forget_slots(freed)
            self.kv.free(freed)

    # ---- leaving -------------------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Free a leaving request's KV slots (to the prefix cache or the free list) and its row."""
        if req.slots:
            if self.cache is not None:
                self._cache_kv(req)
            else:
                self.kv.free(req.slots)
            req.slots = []
        req.filled = 0
        if req.row:
            self.rows.free(req.row)
            self._freed_rows.append(req.row)
            req.row = 0

    def _cache_kv(self, req: Req) -> None:
        """Hand a leaving request's KV to the prefix cache (finish, abort or retraction).

        Cached: positions [0, n), n = min(filled, len(fill_ids) - 1) (at least what the tree already holds
        for it), whose writing step has been launched and whose token the host knows; slots of prefill
        chunks never launched are freed. Never the last token: the last sampled one has no KV yet, and a
        request that finished in batch k-1 but rides in batch k writes its extra token's KV at slot
        slots[n]: that slot is freed, not cached (it also keeps the tree the same under both loops).
        Every reader of a cached slot is launched after this point, so after the step that wrote it.
        """
        fill = req.fill_ids()
        # A hybrid's state covers every launched token: one that rode in a step after finishing has its KV too
        n = max(min(req.filled, len(fill) - (0 if self.checkpoints is not None else 1)), req.cached_len)
        held = self.cache.insert(fill[:n], req.slots[:n])
        if self.disk is not None:          # written by launched steps: the next launch may copy them
            self.disk.save(fill[:n], self.cache.match_prefix(fill[:n])[0])
        if self.checkpoints is not None and n == req.filled:
            self._checkpoint(req, fill[:n], after_step=False)
        if req.prompt_state is not None:                   # its prompt's end, now in the tree (n >= it)
            depth, cid = req.prompt_state
            self.checkpoints.attach(self.cache, self.cache.match_prefix(fill[:depth])[1] if depth <= n
                                    else self.cache.root, cid)
            req.prompt_state = None
        # [0, cached_len): the tree's own slots; [cached_len, held): this request's copy of KV the tree got
        # meanwhile from another request (freed); [held, n): now the tree's; [n, allocated): freed.
        self.kv.free(req.slots[req.cached_len:max(held, req.cached_len)] + req.slots[n:])
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = None, 0

    def cache_prefill(self, req: Req) -> None:
        """Share a running request's prompt KV as soon as the step that writes it is picked, so requests
        admitted in later steps hit it (requests sharing a system prompt need not wait for a finish).

        Safe because the picked step is launched before any later step is picked: every reader of these
        slots is launched after their writer (not in the same step: a step gathers keys before it writes).
        The request's lock moves to the new leaf. Skipped when the tree has meanwhile got KV of its own for
        these tokens (a batch mate with the same prefix): the request keeps its copy, and the finish path
        frees it."""
        if self.cache is None or req.filled <= req.cached_len:
            return
        ids = req.fill_ids()[:req.filled]
        held = len(self.cache.match_prefix(ids)[0])
        start = req.cached_len
        if held != start:
            # A hybrid's state here is still worth keeping where the tree holds these very tokens (a batch mate
            # sharing the prompt put them there): a chat's next turn that leaves this prompt's answer resumes here
            if self.checkpoints is None or not self.checkpoints.wants(start, req.filled):
                return
            if held == req.filled:
                self._checkpoint(req, ids, after_step=True)
            elif req.filled == len(req.prompt_ids) and req.prompt_state is None:
                # its prompt's end, which the tree lacks until it leaves: saved now, attached then (_cache_kv)
                cid = self.checkpoints.take(self.cache, None)
                if cid is not None:
                    if self.disk is not None:
                        self.disk.forget_cid(cid)
                    self.checkpoints.save(req.row, cid, after_step=True)
                    req.prompt_state = (req.filled, cid)
            return
        self.cache.insert(ids, req.slots[:req.filled])
        slots, node = self.cache.match_prefix(ids)
        if self.disk is not None:          # the step being picked writes the last chunk: one launch later
            self.disk.save(ids, slots, written=False)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, len(slots)
        if self.checkpoints is not None and self.checkpoints.wants(start, req.filled):
            self._checkpoint(req, ids, after_step=True)       # saved once the step that ends the chunk has run

    def _checkpoint(self, req: Req, ids: list[int], after_step: bool) -> None:
        """Save the request row's state as the checkpoint of the node `ids` ends at (unless it has one)."""
        slots, node = self.cache.match_prefix(ids)
        if node is not self.cache.root and node.checkpoint is None:
            cid = self.checkpoints.take(self.cache, node)
            if cid is not None:
                self.checkpoints.save(req.row, cid, after_step)
                if self.disk is not None:              # the state entry, once the checkpoint copy has run
                    self.disk.forget_cid(cid)
                    self.disk.save_state(ids, slots[len(ids) // CHUNK_TOKENS * CHUNK_TOKENS:], cid, after_step)

    def restore_state(self, req: Req) -> None:
        """A hybrid request's first chunk: its row's state from the checkpoint its match stopped at."""
        if req.state_from is not None:
            self.checkpoints.restore(req.state_from, req.row)
            req.state_from = None

    def take_state_ops(self):
        """The state copies the next launched step makes (StepInput.state_ops), or None for a model without."""
        if self.checkpoints is None:
            return None
        self.checkpoints.reclaim(self.cache)
        return self.checkpoints.take_ops()

    def take_freed_rows(self) -> list[int]:
        """Rows freed since the last call (the next launch may poison their FutureMap rows)."""
        rows, self._freed_rows = self._freed_rows, []
        return rows

    # ---- checks and stats ----------------------------------------------------------------------------------
    def audit(self, live: Iterable[Req], pending_release: Iterable[int]) -> None:
        """Debug check: every KV slot is free, held by a live request, owned by the tree, or waiting to be
        released once an in-flight step is waited for (pending_release), exactly once."""
        owned = list(self.kv._free)
        if self.cache is not None:
            owned += self.cache.all_slots()
        for req in live:
            owned += req.slots[req.cached_len:]
        owned += list(pending_release)
        assert sorted(owned) == list(range(self.kv.num_slots)), "KV slot ownership is not a partition"

    def stats(self) -> dict:
        cached = self.cache.total_size if self.cache is not None else 0
        evictable = self.cache.evictable_size if self.cache is not None else 0
        return {
            "total_kv_slots": self.kv.num_slots,
            "free_kv_slots": self.kv.available(),
            "cached_kv_slots": cached,          # owned by the prefix cache (locked or not)
            "evictable_kv_slots": evictable,    # cached and unlocked: available to new steps
            "total_req_rows": self.rows.size,
            "free_req_rows": self.rows.available(),
            "kv_usage": 1.0 - self.available() / self.kv.num_slots,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            **({} if not self.recurrent else {
                "state_bytes": self.recurrent * (self.rows.size - self.rows.available()
                                                 + (self.checkpoints.held() if self.checkpoints else 0))}),
            **({} if self.disk is None else self.disk.as_stats()),
            **({} if self.checkpoints is None else {
                "state_checkpoints": self.checkpoints.size, "held_state_checkpoints": self.checkpoints.held(),
                "state_checkpoints_saved": self.checkpoints.saved,
                "state_checkpoints_restored": self.checkpoints.restored}),
        }

