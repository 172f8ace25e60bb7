"""Radix prefix cache: the tree itself, outputs equal with the cache on and off under both loops, exact hit
accounting, eviction under a small KV cache, aborts and retraction of requests that share a prefix. The
FutureMap is poisoned (-1) in these engines, and every run ends with the KV ownership audit (conftest)."""
from __future__ import annotations

import pytest

from tests.helpers.engine_checks import assert_no_leaks
from tandem import SamplingParams
from tandem.memory.radix_cache import RadixCache
from tests.scheduler.test_overlap import greedy, run_script

LOOPS = ("serial", "overlap")


def seeded(n, seed):
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=n, ignore_eos=True)


# ---- the tree --------------------------------------------------------------------------------------------
def test_radix_match_insert_split_lock_evict():
    t = RadixCache()
    assert t.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert t.insert([1, 2, 5], [20, 21, 22]) == 2          # shares [1, 2]: the caller frees 20, 21
    assert t.total_size == 5 and t.evictable_size == 5
    slots, node = t.match_prefix([1, 2, 3, 9])
    assert slots == [10, 11, 12]                           # split inside the edge [3, 4]
    t.lock(node)
    assert t.protected_size == 3 and t.evictable_size == 2
    assert sorted(t.evict(10)) == [13, 22]                 # only unlocked leaves go
    assert t.match_prefix([1, 2, 5])[0] == [10, 11]
    t.unlock(node)
    assert sorted(t.evict(1)) == [12] and t.total_size == 2   # LRU leaf first, then its parent
    assert sorted(t.evict(5)) == [10, 11] and t.total_size == 0


def test_radix_eviction_is_lru():
    t = RadixCache()
    t.insert([1, 1], [0, 1])
    t.insert([2, 2], [2, 3])
    t.match_prefix([1, 1])                                 # touch [1, 1]: [2, 2] is now least recent
    assert t.evict(1) == [2, 3]


# ---- outputs: cache on == cache off ------------------------------------------------------------------------
def _shared_prefix_batch(prefix_len=40, n=6):
    prefix = [(7 * i) % 900 + 5 for i in range(prefix_len)]
    reqs = [(f"s{i}", prefix + [100 + i, 200 + i], greedy(6 + i, ignore_eos=True)) for i in range(n)]
    reqs += [(f"t{i}", prefix + [300 + i], seeded(7, seed=i)) for i in range(3)]
    reqs += [("same", prefix + [100, 200], greedy(6, ignore_eos=True))]           # repeats s0
    return reqs


def test_cache_on_equals_off_shared_prefix_and_repeats(tiny_llama, make_llm):
    on, off = make_llm(tiny_llama), make_llm(tiny_llama, prefix_cache=False)
    batch = _shared_prefix_batch()
    first_off = run_script(off, "serial", batch, {})
    for loop in LOOPS:
        assert run_script(off, loop, batch, {}) == first_off
        # The first run fills the cache; after it every prompt is cached but its last token.
        assert run_script(on, loop, batch, {}) == first_off
    assert on.stats()["prefix_cache_hits"] > 0 and off.stats()["prefix_cache_hits"] == 0


def test_cache_on_equals_off_multi_turn(tiny_qwen2, make_llm):
    on, off = make_llm(tiny_qwen2, scheduler="serial"), make_llm(tiny_qwen2, prefix_cache=False)
    outs = {}
    for llm in (on, off):           # the cached engine runs serial, the plain one overlap
        histories = [[11 + c, 12, 13, 14 + c] for c in range(3)]
        turns = []
        for turn in range(3):
            params = [greedy(5, ignore_eos=True), seeded(5, 40 + turn), greedy(4, ignore_eos=True)]
            res = llm.generate(histories, params, use_tqdm=False)
            turns.append([(r.token_ids, r.num_cached_tokens) for r in res])
            # Each turn resends the history: prompt + answer + the user's next message.
            histories = [h + r.token_ids + [50 + turn, 51 + turn] for h, r in zip(histories, res)]
        outs[llm] = turns
        assert_no_leaks(llm)
    assert [[t for t, _ in turn] for turn in outs[on]] == [[t for t, _ in turn] for turn in outs[off]]
    # Turn 2 and 3 hit their own history up to the last answer token (its KV was never written).
    for turn in (1, 2):
        for (_, cached), (_, none) in zip(outs[on][turn], outs[off][turn]):
            assert cached > 0 and none == 0


# ---- exact hit accounting ----------------------------------------------------------------------------------
@pytest.mark.parametrize("invariant", [True, False])
def test_hit_accounting_full_partial_none(tiny_llama, make_llm, invariant):
    """Hits of a full, a partial and no cached prefix, with batch invariance (the default: a decode step's KV is
    the bits a prompt token gets) and without. A prompt holding cached outputs hits through them."""
    llm = make_llm(tiny_llama, scheduler="serial", batch_invariant=invariant)
    p = [5, 6, 7, 8, 9, 10, 11, 12]

    def cached(prompt, n=3):
        return llm.generate([prompt], greedy(n, ignore_eos=True), use_tqdm=False)[0]

    first = cached(p)
    assert first.num_cached_tokens == 0                                     # no hit
    # Cached now: prompt + outputs but the last (no KV yet): 8 + 3 - 1 = 10 tokens.
    assert llm.stats()["cached_kv_slots"] == 10
    assert cached(p).num_cached_tokens == len(p) - 1                        # full hit: last token computed
    assert cached(p[:5] + [99, 98]).num_cached_tokens == 5                  # partial hit
    through = 10
    assert cached(p + first.token_ids[:2] + [77]).num_cached_tokens == through  # the prompt and the outputs
    assert cached([400, 401, 402]).num_cached_tokens == 0                   # no hit
    s = llm.stats()
    assert s["prefix_cache_hits"] == 7 + 5 + through and s["prefix_cache_queries"] == 8 + 8 + 7 + 11 + 3


@pytest.mark.parametrize("loop", LOOPS)
def test_hit_on_a_prefix_another_request_is_decoding(tiny_llama, make_llm, loop):
    llm = make_llm(tiny_llama, scheduler=loop)
    prefix = list(range(60, 80))
    llm.generate([prefix + [1]], greedy(1, ignore_eos=True), use_tqdm=False)     # caches prefix + [1]
    eng, seen, added = llm.engine, {}, []
    a = eng.make_request(prefix + [2], greedy(12, ignore_eos=True))
    b = eng.make_request(prefix + [3], greedy(3, ignore_eos=True))
    eng.add_request(a)
    old = eng._sink

    def sink(outputs):
        for o in outputs:
            seen.setdefault(o.rid, o.num_cached_tokens)
        eng.scheduler.audit_kv()                 # ownership is a partition at every step
        if not added:
            assert eng.scheduler.memory.cache.protected_size == len(prefix) + 1     # a's prompt, shared at launch
            eng.add_request(b)
            added.append(b)

    eng._sink = sink
    try:
        eng.run()
    finally:
        eng._sink = old
    assert seen[a.rid] == len(prefix) and seen[b.rid] == len(prefix)


# ---- memory: eviction, aborts, retraction ------------------------------------------------------------------
def test_eviction_under_small_kv_cache(tiny_qwen2, make_llm):
    llm = make_llm(tiny_qwen2, kv_cache_tokens=200, max_running_requests=6)
    off = make_llm(tiny_qwen2, kv_cache_tokens=200, max_running_requests=6, prefix_cache=False)
    reqs = [(f"e{i}", [(13 * i + j) % 800 + 3 for j in range(20 + 3 * (i % 4))], greedy(8, ignore_eos=True))
            for i in range(12)]
    reqs += [(f"r{i}", reqs[i][1], greedy(8, ignore_eos=True)) for i in range(4)]    # repeats
    plain = run_script(off, "overlap", reqs, {})
    for loop in LOOPS:
        assert run_script(llm, loop, reqs, {}) == plain
    s = llm.stats()
    assert s["cached_kv_slots"] > 0 and s["free_kv_slots"] + s["evictable_kv_slots"] == 200


def test_aborts_in_flight_among_shared_prefix(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    prefix = [(5 * i) % 700 + 9 for i in range(25)]
    initial = [(f"a{i}", prefix + [i + 1], greedy(25, ignore_eos=True)) for i in range(5)]
    full = run_script(llm, "serial", initial, {})
    for loop in LOOPS:
        out = run_script(llm, loop, initial, {2: [("abort", "a1")], 4: [("abort", "a3"), ("abort", "a4")]})
        for label in ("a0", "a2"):
            assert out[label] == full[label]
        for label in ("a1", "a3", "a4"):
            toks, reason = out[label]
            assert reason == "abort" and toks == full[label][0][:len(toks)]


def test_retraction_with_shared_prefix_hits_on_reprefill(tiny_llama, make_llm):
    prefix = [(3 * i) % 500 + 7 for i in range(30)]
    initial = [(f"r{i}", prefix + [i + 2] * (3 + i), greedy(40, ignore_eos=True)) for i in range(6)]
    llm = make_llm(tiny_llama, kv_cache_tokens=200)
    off = make_llm(tiny_llama, kv_cache_tokens=200, prefix_cache=False)
    ref = run_script(off, "serial", initial, {})
    s = llm.engine.scheduler
    for loop in LOOPS:
        retractions, hits = s.retractions, s.memory.prefix_hits
        assert run_script(llm, loop, initial, {}) == ref
        assert s.retractions > retractions and s.memory.prefix_hits > hits
