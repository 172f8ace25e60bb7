"""The prefix cache's state checkpoints (a hybrid model's): where the radix tree keeps them through splits and
evictions, how deep a match may go, which id a new checkpoint takes, and the order of the copies a step makes."""
from __future__ import annotations

import numpy as np

from tandem.memory.radix_cache import RadixCache
from tandem.memory.state_checkpoints import RESTORE, SAVE, SAVE_AFTER, StateCheckpoints


def _tree_with(ids: list[int], ckpt_at: list[int], ckpts: StateCheckpoints) -> RadixCache:
    cache = RadixCache()
    cache.insert(ids, list(range(len(ids))))
    for depth in ckpt_at:
        _, node = cache.match_prefix(ids[:depth])
        assert ckpts.take(cache, node) is not None
    return cache


def test_a_match_stops_at_the_deepest_checkpoint_and_splits_keep_it_below():
    ckpts = StateCheckpoints(4)
    ids = list(range(10, 30))
    cache = _tree_with(ids, [8, 15], ckpts)
    slots, node = cache.match_checkpointed(ids[:12] + [99])         # KV for 12, the state only for 8
    assert len(slots) == 8 and node.checkpoint is not None
    slots, node = cache.match_checkpointed(ids + [1])
    assert len(slots) == 15
    assert cache.match_checkpointed(ids[:5])[1] is cache.root      # no state below 8: from position 0
    _, upper = cache.match_prefix(ids[:11])                          # a split between 8 and 15: 15 keeps its id
    assert upper.checkpoint is None and len(cache.match_checkpointed(ids)[0]) == 15


def test_ids_come_back_from_evicted_nodes_then_from_the_least_recent_unlocked_one():
    ckpts = StateCheckpoints(2)
    cache = _tree_with(list(range(10)), [4, 10], ckpts)
    assert ckpts.available() == 0
    other = cache.insert([50, 51, 52], [20, 21, 22])
    assert other == 0
    _, node = cache.match_prefix([50, 51, 52])
    cache.lock(cache.match_prefix(list(range(10)))[1])                # both old ones locked: none to take
    assert ckpts.take(cache, node) is None
    cache.unlock(cache.match_prefix(list(range(10)))[1])
    assert ckpts.take(cache, node) is not None                        # the least recently used one gave its id
    assert cache.match_checkpointed(list(range(10)))[1].checkpoint is not None   # depth 10: resumed from, kept
    assert sum(n.checkpoint is not None for n in _nodes(cache)) == 2
    cache.evict(100)                                                  # every leaf gone: their ids come back
    ckpts.reclaim(cache)
    assert ckpts.available() == 2


def _nodes(cache: RadixCache) -> list:
    out, stack = [], [cache.root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def test_a_steps_copies_save_then_restore_then_save_after_the_forward():
    ckpts = StateCheckpoints(4, every=32)
    ckpts.save(3, 0, after_step=True)
    ckpts.restore(1, 5)
    ckpts.save(2, 1)
    ops = ckpts.take_ops().reshape(-1, 3)
    assert ops.tolist() == [[SAVE, 2, 1], [RESTORE, 1, 5], [SAVE_AFTER, 3, 0]]
    assert len(ckpts.take_ops()) == 0 and ckpts.saved == 2 and ckpts.restored == 1
    assert ckpts.wants(0, 40) and not ckpts.wants(40, 60) and ckpts.wants(60, 70)
    assert StateCheckpoints(1).wants(5, 6)                           # every=0: every chunk's end
    assert isinstance(ckpts.take_ops(), np.ndarray)


def test_a_full_pool_gives_up_the_checkpoint_least_recently_saved_or_resumed_from():
    """By use, not by the matches passing through a node: a chat's turn-1 end, touched by a match since but neither
    saved nor resumed from, goes before turn 2's end."""
    ckpts = StateCheckpoints(3)
    turn1, turn2 = list(range(10)), list(range(10)) + [7, 7, 7]
    cache = _tree_with(turn2, [10, 13], ckpts)                   # turn 1's end, then turn 2's under it
    cache.insert([50, 51], [30, 31])                             # another chat's end, used after
    _, other = cache.match_prefix([50, 51])
    assert ckpts.take(cache, other) is not None and ckpts.available() == 0
    cache.match_prefix(turn1)                                    # turn 1's node touched last (not a use)
    _, new = cache.match_prefix([50])
    ckpts.take(cache, new)
    assert cache.match_checkpointed(turn2)[1].checkpoint is not None      # turn 2's end kept
    assert len(cache.match_checkpointed(turn2)[0]) == 13 and len(cache.match_checkpointed(turn1 + [1])[0]) < 10
