"""Chunked prefill and mixed steps: the same outputs as whole-prompt prefill and separate steps, under both
loops, with the prefix cache, aborts, retraction and a randomized mix. FutureMap poison is on throughout."""
from __future__ import annotations

import random

import pytest

import tandem.scheduler.loops as loops
from tandem import SamplingParams
from tandem.scheduler.launch import launch_step
from tests.scheduler.test_overlap import greedy, run_script

LOOPS = ("serial", "overlap")
CHUNK = 16


def seeded(n, seed):
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=n, ignore_eos=True)


def _prompt(i, n):
    return [(17 * i + 5 * j) % 900 + 3 for j in range(n)]


def test_chunked_equals_unchunked_and_mixed_equals_separate(tiny_llama, make_llm):
    # Prompts of 1 to 4 chunks (and off by one), greedy and seeded; two arrive while others decode.
    initial = [(f"p{i}", _prompt(i, n), greedy(10, ignore_eos=True) if i % 2 else seeded(10, i))
               for i, n in enumerate([CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK - 1, 4 * CHUNK, 5])]
    events = {3: [("add", "late", _prompt(9, 3 * CHUNK + 2), seeded(8, 99))],
              5: [("add", "later", _prompt(10, 4 * CHUNK), greedy(6, ignore_eos=True))]}
    whole = make_llm(tiny_llama, prefix_cache=False, enable_mixed_chunk=False)
    ref = run_script(whole, "serial", initial, events)
    chunked = make_llm(tiny_llama, prefix_cache=False, max_prefill_tokens=CHUNK, mixed_prefill_tokens=CHUNK)
    for mixed in (False, True):
        chunked.engine.config = chunked.engine.config.replace(enable_mixed_chunk=mixed)
        for loop in LOOPS:
            assert run_script(chunked, loop, initial, events) == ref, (mixed, loop)


def test_mixed_steps_carry_decode_rows(tiny_llama, make_llm, monkeypatch):
    llm = make_llm(tiny_llama, max_prefill_tokens=64, mixed_prefill_tokens=8)
    kinds = []

    def launch(s, batch):
        kinds.append((batch.num_decode, batch.num_tokens - batch.num_decode))
        return launch_step(s, batch)

    monkeypatch.setattr(loops, "launch_step", launch)
    out = run_script(llm, "overlap", [("run", [5, 6, 7], greedy(12, ignore_eos=True))],
                     {2: [("add", "long", _prompt(1, 40), greedy(3, ignore_eos=True))]})
    mixed = [k for k in kinds if k[0] and k[1]]
    assert len(mixed) == 5 and all(p <= 8 for _, p in mixed)          # 40 tokens in chunks of 8
    assert len(out["run"][0]) == 12 and len(out["long"][0]) == 3


def test_chunked_with_prefix_cache_hit(tiny_qwen2, make_llm):
    llm = make_llm(tiny_qwen2, max_prefill_tokens=CHUNK, mixed_prefill_tokens=CHUNK)
    off = make_llm(tiny_qwen2, prefix_cache=False)
    base = _prompt(3, 3 * CHUNK)
    reqs = [("a", base + [7], greedy(5, ignore_eos=True))]
    more = [("b", base + [8] + _prompt(4, 2 * CHUNK), seeded(6, 1)), ("c", base[:CHUNK + 3], greedy(4))]
    for loop in LOOPS:
        assert run_script(llm, loop, reqs, {2: [("add",) + r for r in more]}) == \
            run_script(off, loop, reqs, {2: [("add",) + r for r in more]})
    assert llm.engine.scheduler.memory.prefix_hits >= 3 * CHUNK


def test_abort_and_retraction_mid_prefill(tiny_llama, make_llm):
    initial = [(f"r{i}", _prompt(i, 15 + 4 * i), greedy(35, ignore_eos=True)) for i in range(7)]
    llm = make_llm(tiny_llama, kv_cache_tokens=260, max_prefill_tokens=64, mixed_prefill_tokens=16)
    off = make_llm(tiny_llama, kv_cache_tokens=260, prefix_cache=False, enable_mixed_chunk=False)
    ref = run_script(off, "serial", initial, {})
    for loop in LOOPS:
        retractions = llm.engine.scheduler.retractions
        assert run_script(llm, loop, initial, {}) == ref
        assert llm.engine.scheduler.retractions > retractions
        out = run_script(llm, loop, initial, {1: [("abort", "r4")], 3: [("abort", "r2")]})
        assert out["r4"][1] == "abort" and out["r2"][1] == "abort"
        assert {k: v for k, v in out.items() if k not in ("r2", "r4")} == \
            {k: v for k, v in ref.items() if k not in ("r2", "r4")}


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_cache_chunks_mixed_aborts(tiny_qwen2, make_llm, seed):
    """Shared prefixes, repeats, long prompts, arrivals, aborts and a small KV cache, both loops, against the
    plain engine (no cache, whole prompts, separate steps)."""
    rng = random.Random(seed)
    kv = rng.choice([400, 3000])
    kw = dict(kv_cache_tokens=kv, max_running_requests=8)
    llm = make_llm(tiny_qwen2, max_prefill_tokens=rng.choice([8, 24]), mixed_prefill_tokens=rng.choice([4, 16]),
                   **kw)
    plain = make_llm(tiny_qwen2, prefix_cache=False, enable_mixed_chunk=False, **kw)
    prefixes = [_prompt(50 + k, rng.randrange(5, 60)) for k in range(3)]
    reqs = []
    for i in range(20):
        ids = rng.choice(prefixes) + _prompt(i, rng.randrange(1, 12)) if rng.random() < 0.7 else \
            _prompt(100 + i, rng.randrange(1, 70))
        p = greedy(rng.randrange(1, 15), ignore_eos=True) if rng.random() < 0.5 else seeded(rng.randrange(1, 15),
                                                                                               rng.randrange(99))
        reqs.append((f"q{i}", ids, p))
    reqs.append(("again", reqs[0][1], reqs[0][2]))
    events: dict[int, list] = {}
    for r in reqs[6:]:
        events.setdefault(rng.randrange(1, 20), []).append(("add",) + r)
    aborted = {f"q{i}" for i in rng.sample(range(6), 2)}
    for label in aborted:
        events.setdefault(rng.randrange(1, 8), []).append(("abort", label))
    ref = run_script(plain, "serial", reqs[:6], events)
    keep = set(ref) - aborted
    for loop in LOOPS:
        out = run_script(llm, loop, reqs[:6], events)
        assert {k: out[k] for k in keep} == {k: ref[k] for k in keep}, loop
        for label in aborted:
            assert out[label][1] in ("abort", "length")


def test_decode_rows_of_very_different_lengths(tiny_llama, make_llm):
    """Short and long rows decode in two attention groups (step_layout.decode_split): outputs as if alone."""
    from tandem.device.step_layout import decode_split
    import numpy as np
    assert decode_split(np.array([4, 5, 6, 200])) == [3] and decode_split(np.array([50, 60, 70])) == []
    llm = make_llm(tiny_llama, prefix_cache=False)
    reqs = [("long", _prompt(1, 150), greedy(8, ignore_eos=True))] + \
        [(f"s{i}", _prompt(2 + i, 3), seeded(8, i)) for i in range(3)]
    together = run_script(llm, "overlap", reqs, {})
    for r in reqs:
        assert run_script(llm, "serial", [r], {})[r[0]] == together[r[0]]


@pytest.mark.parametrize("loop", LOOPS)
def test_short_arrival_goes_before_the_next_chunk(tiny_llama, make_llm, loop):
    # A 4-chunk prompt is being prefilled; a short request arrives right after the first chunk's launch. It goes
    # alone in the next step (it waits for the chunk in flight only), the long prompt stands aside once, and
    # the outputs are those of the requests run alone.
    llm = make_llm(tiny_llama, prefix_cache=False, max_prefill_tokens=CHUNK, mixed_prefill_tokens=CHUNK)
    eng = llm.engine
    long_ids, short_ids, params = _prompt(1, 4 * CHUNK), _prompt(2, 5), greedy(4, ignore_eos=True)
    alone = {label: run_script(llm, loop, [(label, ids, params)], {})[label]
             for label, ids in (("long", long_ids), ("short", short_ids))}
    eng.config = eng.config.replace(scheduler=loop)
    long, short = eng.make_request(long_ids, params), eng.make_request(short_ids, params)
    steps, out = [], {}

    def launch(s, batch):
        steps.append(sorted("long" if r is long else "short" for r in batch.reqs))
        handle = launch_step(s, batch)
        if len(steps) == 1:
            eng.add_request(short)
        return handle

    def sink(outputs):
        for o in outputs:
            out.setdefault(o.rid, []).extend(o.new_token_ids)

    old, eng._sink, loops.launch_step = eng._sink, sink, launch
    try:
        eng.add_request(long)
        eng.run()
    finally:
        eng._sink = old
        loops.launch_step = launch_step
    assert steps[0] == ["long"] and steps[1] == ["short"] and "long" in steps[2], steps   # then a mixed step
    assert out[long.rid] == alone["long"][0] and out[short.rid] == alone["short"][0]


def test_long_arrival_does_not_make_a_started_prefill_stand_aside(tiny_llama, make_llm):
    # An arrival that does not fit the step whole queues behind the started prefill (no round robin of
    # half-prefilled prompts in a burst).
    llm = make_llm(tiny_llama, prefix_cache=False, max_prefill_tokens=CHUNK, mixed_prefill_tokens=CHUNK)
    eng = llm.engine
    first, second = (eng.make_request(_prompt(i, 3 * CHUNK), greedy(2, ignore_eos=True)) for i in (3, 4))
    steps = []

    def launch(s, batch):
        steps.append([r is first for r in batch.reqs])
        handle = launch_step(s, batch)
        if len(steps) == 1:
            eng.add_request(second)
        return handle

    loops.launch_step = launch
    try:
        eng.add_request(first)
        eng.run()
    finally:
        loops.launch_step = launch_step
    assert steps[:3] == [[True], [True], [True]], steps                # first's 3 chunks, then second's
