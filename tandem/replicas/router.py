"""The data-parallel router: which replica takes a request.

Two policies, as sglang-router has them:
- "least-load" (default): the live replica with the fewest outstanding tokens (prompt tokens not yet
  prefilled plus tokens still to generate, summed over its open requests); ties go to the lowest index.
- "cache-aware": the router keeps an approximate prefix tree per replica (the prompts it sent there, a
  RadixCache without KV slots, trimmed least recently used). A prompt whose longest match in some tree covers
  at least CACHE_THRESHOLD of it goes to that replica, so that its radix cache serves the prefix; a miss goes
  to the replica with the smallest tree (spreading distinct prefixes). When the loads are out of balance
  (max - min > BALANCE_ABS_TOKENS and max > BALANCE_REL * min) it routes by load instead, as sglang does.
The tree is approximate: the replica may have evicted a prefix the router still holds, and vice versa.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..memory.radix_cache import RadixCache

ROUTERS = ("least-load", "cache-aware")
CACHE_THRESHOLD = 0.5          # matched fraction of the prompt that sends it to the replica holding it
BALANCE_ABS_TOKENS = 2048      # load gap (outstanding tokens) above which cache-aware routes by load ...
BALANCE_REL = 1.5              # ... if the busiest replica also holds this many times the least busy one's load
TREE_TOKENS = 1 << 20          # tokens each replica's approximate tree keeps (least recently used trimmed)


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router sees of one replica when it picks."""
    alive: bool
    outstanding: int           # tokens still to compute for its open requests


def least_loaded(loads: list[ReplicaLoad]) -> int:
    """The live replica with the fewest outstanding tokens (lowest index on a tie); ValueError if none lives."""
    live = [i for i, r in enumerate(loads) if r.alive]
    if not live:
        raise ValueError("no replica is alive")
    return min(live, key=lambda i: (loads[i].outstanding, i))


class Router:
    def __init__(self, num_replicas: int, policy: str = "least-load", tree_tokens: int = TREE_TOKENS) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"the router needs at least one replica, got {num_replicas}")
        self.policy = policy
        self.tree_tokens = tree_tokens
        self.trees = [RadixCache() for _ in range(num_replicas)] if policy == "cache-aware" else []

    def pick(self, prompt_ids: list[int], loads: list[ReplicaLoad]) -> int:
        """The replica for this prompt (and, cache-aware, remember that it now holds the prompt)."""
        if self.policy == "least-load":
            return least_loaded(loads)
        i = self._cache_aware(prompt_ids, loads)
        self._remember(i, prompt_ids)
        return i

    def matched(self, i: int, prompt_ids: list[int]) -> int:
        """Tokens of the prompt replica i's approximate tree holds (a prefix)."""
        return len(self.trees[i].match_prefix(prompt_ids)[0])

    def forget(self, i: int) -> None:
        """Replica i died: whatever it cached is gone."""
        if self.trees:
            self.trees[i] = RadixCache()

    def _cache_aware(self, prompt_ids: list[int], loads: list[ReplicaLoad]) -> int:
        live = [i for i, r in enumerate(loads) if r.alive]
        if not live:
            raise ValueError("no replica is alive")
        most = max(loads[i].outstanding for i in live)
        least = min(loads[i].outstanding for i in live)
        if most - least > BALANCE_ABS_TOKENS and most > BALANCE_REL * least:
            return least_loaded(loads)
        best = max(live, key=lambda i: (self.matched(i, prompt_ids), -loads[i].outstanding, -i))
        if self.matched(best, prompt_ids) >= CACHE_THRESHOLD * len(prompt_ids) > 0:
            return best
        return min(live, key=lambda i: (self.trees[i].total_size, loads[i].outstanding, i))

    def _remember(self, i: int, prompt_ids: list[int]) -> None:
        tree = self.trees[i]
        tree.insert(list(prompt_ids), [0] * len(prompt_ids))    # no KV here: the slots are placeholders
        if tree.total_size > self.tree_tokens:
            tree.evict(tree.total_size - self.tree_tokens)
