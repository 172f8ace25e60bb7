"""The data-parallel router on crafted loads and prefixes (no engine), and the core split between replicas."""
from __future__ import annotations

import pytest

from tandem.replicas.replica_set import DataParallel, split_cores
from tandem.replicas.router import BALANCE_ABS_TOKENS, ReplicaLoad, Router, least_loaded


def loads(*outstanding: int, dead: tuple[int, ...] = ()) -> list[ReplicaLoad]:
    return [ReplicaLoad(i not in dead, n) for i, n in enumerate(outstanding)]


def test_least_load_picks_fewest_outstanding_tokens_among_the_living():
    r = Router(3)
    assert r.pick([1, 2, 3], loads(500, 20, 300)) == 1
    assert r.pick([1, 2, 3], loads(0, 0, 0)) == 0                  # a tie: the lowest index
    assert r.pick([1, 2, 3], loads(500, 20, 300, dead=(1,))) == 2   # a dead replica takes nothing
    with pytest.raises(ValueError, match="no replica is alive"):
        least_loaded(loads(1, 2, dead=(0, 1)))


def test_cache_aware_follows_the_longest_prefix_and_spreads_misses():
    r = Router(2, "cache-aware")
    system = list(range(100, 140))                                  # a 40-token shared "system prompt"
    other = list(range(500, 530))
    assert r.pick(system + [1, 2], loads(0, 0)) == 0                # empty trees: the smallest, lowest index
    assert r.pick(other + [3], loads(0, 0)) == 1                    # a miss goes to the smaller tree
    # The same prefix returns to its replica even when that one is busier (within the balance bounds) ...
    assert r.pick(system + [7, 8, 9], loads(900, 0)) == 0
    assert r.pick(other + [4, 5], loads(0, 900)) == 1
    assert r.matched(0, system + [7]) == 41 and r.matched(1, system) == 0
    # ... a prompt matched below the threshold is a miss: to the smaller tree (replica 1: 33 tokens, not 45) ...
    assert (r.trees[0].total_size, r.trees[1].total_size) == (45, 33)
    assert r.pick(system[:5] + list(range(900, 960)), loads(0, 0)) == 1
    # ... and past the balance bounds the load decides, whatever the cache holds.
    assert r.pick(system + [1], loads(BALANCE_ABS_TOKENS * 2, 10)) == 1
    r.forget(0)                                                     # replica 0 died: its tree is gone
    assert r.matched(0, system) == 0
    assert r.pick(system, loads(0, 0, dead=(1,))) == 0


def test_cache_aware_tree_is_bounded():
    r = Router(1, "cache-aware", tree_tokens=100)
    for k in range(10):
        r.pick([k * 1000 + j for j in range(30)], loads(0))
    assert r.trees[0].total_size <= 100
    assert r.matched(0, [9000 + j for j in range(30)]) == 30        # the newest prompt is kept


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="router must be one of"):
        Router(2, "random")
    with pytest.raises(ValueError, match="--dp must be >= 1"):
        DataParallel(0)
    with pytest.raises(ValueError, match="needs at least 3 cores"):
        split_cores([0, 1], 3)
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3, 4]]
    from tandem.config import EngineConfig
    from tandem.replicas.replica_set import replica_cores
    with pytest.raises(ValueError, match="--nnodes 2 is not supported"):
        replica_cores(EngineConfig(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500"), DataParallel(2))
