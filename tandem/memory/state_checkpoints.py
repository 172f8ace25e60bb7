"""StateCheckpoints: the host's bookkeeping of a hybrid model's saved linear-attention states, the prefix cache's
second kind of memory (the first is KV slots).

A recurrent state cannot be cut at any token, so the radix tree keeps checkpoints at chosen depths: where a
finished (or aborted, or retracted) request's computed tokens end, and where a prefill chunk ends (every chunk, or
the first past each multiple of `every` tokens). A later request resumes from the deepest checkpoint at or below
its match (RadixCache.match_checkpointed) and recomputes only from there.

The device holds the states (model/recurrent_state.py: a pool of `size` checkpoints beside the rows' slots); this
class decides which id holds what and queues the copies the next launched step makes, in this order:
  1. saves of released rows (their state is final: every step that wrote it was launched before),
  2. restores into rows whose first chunk resumes from a checkpoint,
  3. the forward,
  4. saves of rows whose chunk in this step ends at a new checkpoint.
A checkpoint id is taken back when its node is evicted, or, when none is free, from the unlocked node whose
checkpoint was least recently saved or resumed from (its KV stays). A locked node's checkpoint is never taken: a request resuming from it
locks it from its admission until it leaves, past the step that restores it.
"""
from __future__ import annotations

import numpy as np

from .radix_cache import Node, RadixCache

SAVE, RESTORE, SAVE_AFTER = 0, 1, 2       # StepInput.state_ops kinds: (kind, from, to) triples


class StateCheckpoints:
    def __init__(self, size: int, every: int = 0) -> None:
        self.size, self.every = size, every
        self._free = list(range(size - 1, -1, -1))
        self._ops: list[tuple[int, int, int]] = []
        self.saved = 0                      # checkpoints saved (counters for /metrics and tests)
        self.restored = 0

    def available(self) -> int:
        return len(self._free)

    def wants(self, start: int, end: int) -> bool:
        """Whether a prefill chunk of [start, end) ends at a checkpoint: every chunk's end, or the first end past
        each multiple of `every`."""
        return self.every <= 0 or end // self.every > start // self.every

    def take(self, cache: RadixCache, node: Node | None) -> int | None:
        """Give `node` a checkpoint id (None: every id is held by a locked node). node None: an id held for a node
        the tree does not have yet (attach() gives it one, or free() takes it back)."""
        self._free.extend(cache.freed_checkpoints)
        cache.freed_checkpoints.clear()
        if not self._free:
            victim = cache.lru_checkpoint()
            if victim is None or victim is node:
                return None
            self._free.append(victim.checkpoint)
            victim.checkpoint = None
        cid = self._free.pop()
        if node is not None:
            node.checkpoint = cid
            cache.use_checkpoint(node)
        return cid

    def attach(self, cache: RadixCache, node: Node, cid: int) -> None:
        """A held id (take(cache, None)) as `node`'s checkpoint, or back to the free list where it has one."""
        if node is cache.root or node.checkpoint is not None:
            self._free.append(cid)
            return
        node.checkpoint = cid
        cache.use_checkpoint(node)

    def save(self, row: int, cid: int, after_step: bool = False) -> None:
        self._ops.append((SAVE_AFTER if after_step else SAVE, row, cid))
        self.saved += 1

    def restore(self, cid: int, row: int) -> None:
        self._ops.append((RESTORE, cid, row))
        self.restored += 1

    def take_ops(self) -> np.ndarray:
        """The queued copies as StepInput.state_ops (flat (kind, from, to) triples, in the order above)."""
        ops = sorted(self._ops, key=lambda op: op[0])          # stable: saves, restores, saves after the forward
        self._ops = []
        return np.array(ops, np.int64).reshape(-1)

    def reclaim(self, cache: RadixCache) -> None:
        """Take back the ids of nodes evicted since the last call."""
        self._free.extend(cache.freed_checkpoints)
        cache.freed_checkpoints.clear()

    def held(self) -> int:
        return self.size - len(self._free)
