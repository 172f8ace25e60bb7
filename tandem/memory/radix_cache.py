"""Radix prefix cache: a tree keyed by token ids whose nodes own KV slots (page size 1).

A node's edge holds a run of token ids and the KV slot of each; the path from the root spells a token prefix
whose KV is valid. Ownership of every KV slot is exactly one of: the allocator's free list, a running
request (the part of `Req.slots` past its cached prefix), or this tree.

- Lock counts: a running request locks the node its cached prefix ends at (and so every ancestor). A locked
  node is never evicted; an unlocked node's slots are *evictable* and count as available memory.
- Eviction frees the least recently used unlocked leaves, only when the allocator runs short.
- What enters the tree: only KV whose writing step has already been launched (the caller's rule, see
  Scheduler.cache_request), so every step that reads a node is launched after the step that wrote it.
- State checkpoints (a hybrid model's, memory/state_checkpoints.py): a node may hold the id of a saved
  linear-attention state after its last token. A split keeps it on the lower part (the edge's end); an evicted
  leaf gives its id back (freed_checkpoints); a match that needs a state stops at the deepest node holding one.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: list[int] = field(default_factory=list)      # token ids of the edge from the parent
    slots: list[int] = field(default_factory=list)    # KV slot of each of those tokens
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)   # first token id -> child
    lock: int = 0
    last_access: int = 0
    checkpoint: int | None = None                     # a saved state after this edge's last token (hybrid models)
    ckpt_used: int = 0                                # when it was last saved or resumed from (the clock's tick)


class RadixCache:
    def __init__(self) -> None:
        self.root = Node()
        self.root.lock = 1                  # the root is never evicted
        self._clock = itertools.count(1)
        self.evictable_size = 0             # slots in unlocked nodes
        self.protected_size = 0             # slots in locked nodes
        self.freed_checkpoints: list[int] = []   # checkpoint ids of evicted nodes, for their owner to take back

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- lookup --------------------------------------------------------------------------------------------
    def match_prefix(self, ids: list[int]) -> tuple[list[int], Node]:
        """The slots of the longest cached prefix of `ids`, and the node it ends at (split there if needed)."""
        node, slots, i = self.root, [], 0
        tick = next(self._clock)
        node.last_access = tick
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = common_prefix(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            slots.extend(child.slots)
            node, i = child, i + n
        return slots, node

    def match_checkpointed(self, ids: list[int]) -> tuple[list[int], Node]:
        """match_prefix cut back to the deepest node on the path that holds a state checkpoint (the root: none):
        a hybrid model's request resumes from that state and recomputes the rest."""
        slots, node = self.match_prefix(ids)
        depth = len(slots)
        while node is not self.root and node.checkpoint is None:
            depth -= len(node.key)
            node = node.parent
        if node is not self.root:
            self.use_checkpoint(node)
        return slots[:depth], node

    def lru_checkpoint(self) -> Node | None:
        """The unlocked node whose checkpoint was used (saved or resumed from) least recently: the one to take back
        when none is free. By use, not by the matches passing through: a chat's next turn resumes from its last
        answer's end (or, where the template re-renders that answer, from its prompt's end), so the kind that
        workload never resumes from goes first."""
        best, stack = None, [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.checkpoint is not None and node.lock == 0 and (best is None or node.ckpt_used < best.ckpt_used):
                best = node
        return best

    def use_checkpoint(self, node: Node) -> None:
        """Mark a node's checkpoint used now (saved, or a request resumes from it)."""
        node.ckpt_used = next(self._clock)

    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n tokens; returns the new upper node (same lock as child)."""
        upper = Node(child.key[:n], child.slots[:n], child.parent, {child.key[n]: child}, child.lock,
                     child.last_access)
        child.parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    # ---- insertion -----------------------------------------------------------------------------------------
    def insert(self, ids: list[int], slots: list[int]) -> int:
        """Add a token prefix and its KV slots. Returns how many leading tokens the tree already held: the
        caller still owns those of its slots that are not the tree's (a duplicate computation) and frees them."""
        assert len(ids) == len(slots)
        node, i = self.root, 0
        tick = next(self._clock)
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = Node(list(ids[i:]), list(slots[i:]), node, last_access=tick)
                node.children[ids[i]] = leaf
                self.evictable_size += len(leaf.slots)
                return i
            n = common_prefix(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, i = child, i + n
        return i

    # ---- locks ---------------------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.evictable_size -= len(node.slots)
                self.protected_size += len(node.slots)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock > 0, "unlock of an unlocked node"
            node.lock -= 1
            if node.lock == 0:
                self.evictable_size += len(node.slots)
                self.protected_size -= len(node.slots)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Free at least n slots (fewer if not that many are evictable): least recently used unlocked leaves
        first; a parent left childless and unlocked becomes a candidate in turn."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < n and heap:
            _, _, leaf = heapq.heappop(heap)
            freed.extend(leaf.slots)
            self.evictable_size -= len(leaf.slots)
            if leaf.checkpoint is not None:
                self.freed_checkpoints.append(leaf.checkpoint)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def all_slots(self) -> list[int]:
        """Every slot the tree owns (for the ownership audit in tests)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.slots)
            stack.extend(node.children.values())
        return out


def common_prefix(key: list[int], ids: list[int], start: int = 0) -> int:
    """How many leading tokens of `key` equal those of ids[start:]."""
    n, m = 0, min(len(key), len(ids) - start)
    while n < m and key[n] == ids[start + n]:
        n += 1
    return n
