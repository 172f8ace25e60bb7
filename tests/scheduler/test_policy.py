"""Who goes first (--scheduling-policy, tandem/scheduler/policy.py) on the tiny model: admission order under each
policy, a running low-priority request retracted for a high-priority arrival and later finished with the
tokens it gives alone (both loops), aging (an old low-priority request goes before newer high-priority ones),
and the fair policy's virtual token counters on a scripted arrival pattern (a flood from one tenant does not
keep another's requests behind all of it). Orders and counts only: nothing depends on how fast a step is."""
from __future__ import annotations

import pytest

from tandem import SamplingParams
from tandem.scheduler.policy import parse_weights
from tests.helpers.engine_checks import assert_no_leaks, run_to_idle


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def drive(llm, initial: list, events: dict[int, list] | None = None, loop: str = "overlap",
          age: dict[str, float] | None = None) -> tuple[list[str], dict[str, list[int]]]:
    """Run `initial` [(label, ids, params)] and, at the n-th processed step, events[n] (the same triples);
    `age`: label -> seconds its arrival is moved back. Returns (labels in finish order, label -> tokens)."""
    eng = llm.engine
    eng.config = eng.config.replace(scheduler=loop)
    label_of, order, tokens, steps = {}, [], {}, [0]

    def add(label, ids, params) -> None:
        req = eng.make_request(ids, params)
        req.arrival_time -= (age or {}).get(label, 0.0)
        label_of[req.rid], tokens[label] = label, []
        eng.add_request(req)

    def sink(outputs) -> None:
        for o in outputs:
            tokens[label_of[o.rid]] += o.new_token_ids
            if o.finished:
                assert o.finish_reason == "length", o
                order.append(label_of[o.rid])
        steps[0] += 1
        for ev in (events or {}).get(steps[0], []):
            add(*ev)
    run_to_idle(llm, sink, lambda: [add(*ev) for ev in initial])
    assert_no_leaks(llm)
    return order, tokens


def prompt(i: int) -> list[int]:
    return [7 + 13 * i + j for j in range(5)]            # distinct: no prefix-cache hit between them


@pytest.mark.parametrize("policy,expected", [("fcfs", ["p5", "p0", "p1"]), ("priority", ["p0", "p1", "p5"])])
def test_admission_order(tiny_llama, make_llm, policy, expected):
    llm = make_llm(tiny_llama, max_running_requests=1, scheduling_policy=policy)
    initial = [(f"p{p}", prompt(i), greedy(4, priority=p)) for i, p in enumerate((5, 0, 1))]
    assert drive(llm, initial)[0] == expected


@pytest.mark.parametrize("loop", ["overlap", "serial"])
@pytest.mark.parametrize("limit", ["running cap", "kv"])
def test_a_high_priority_arrival_retracts_a_running_low_one(tiny_llama, make_llm, loop, limit):
    # "kv": room for one request's KV at a time (two running would not fit), but the running cap allows two.
    kw = dict(max_running_requests=1) if limit == "running cap" else dict(kv_cache_tokens=40, max_running_requests=4)
    llm = make_llm(tiny_llama, scheduling_policy="priority", **kw)
    alone = drive(llm, [("low", prompt(0), greedy(30, priority=3))], loop=loop)[1]["low"]
    retractions = llm.engine.scheduler.retractions
    order, tokens = drive(llm, [("low", prompt(0), greedy(30, priority=3))],
                          {4: [("high", prompt(1), greedy(20 if limit == "kv" else 5, priority=0))]}, loop)
    assert order == ["high", "low"]
    assert llm.engine.scheduler.retractions > retractions
    assert tokens["low"] == alone                        # retracted, re-prefilled, same tokens


def test_a_preempted_request_keeps_its_place(tiny_llama, make_llm):
    # "first" runs, "second" (same priority, later) waits; "high" retracts "first", which then goes before "second".
    llm = make_llm(tiny_llama, max_running_requests=1, scheduling_policy="priority")
    initial = [("first", prompt(0), greedy(20, priority=3)), ("second", prompt(1), greedy(4, priority=3))]
    order, _ = drive(llm, initial, {4: [("high", prompt(2), greedy(4, priority=0))]})
    assert order == ["high", "first", "second"] and llm.engine.scheduler.retractions == 1


def test_equal_priorities_never_preempt(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_running_requests=1, scheduling_policy="priority")
    order, _ = drive(llm, [("first", prompt(0), greedy(12, priority=2))],
                     {3: [("second", prompt(1), greedy(4, priority=2))]})
    assert order == ["first", "second"] and llm.engine.scheduler.retractions == 0


def test_aging_lets_an_old_low_priority_request_go_first(tiny_llama, make_llm):
    # priority_aging 10 s: arrived 1000 s earlier, priority 50 ranks as -50, before newer priority-0 requests.
    llm = make_llm(tiny_llama, max_running_requests=1, scheduling_policy="priority", priority_aging=10.0)
    initial = [("new0", prompt(0), greedy(3, priority=0)), ("new1", prompt(1), greedy(3, priority=0)),
               ("old", prompt(2), greedy(3, priority=50))]
    assert drive(llm, initial, age={"old": 1000.0})[0] == ["old", "new0", "new1"]
    assert drive(llm, initial)[0] == ["new0", "new1", "old"]     # not aged: last


def test_fair_share_interleaves_tenants_and_counts_their_tokens(tiny_llama, make_llm):
    flood = [(f"a{i}", prompt(i), greedy(4, user="a")) for i in range(5)]
    trickle = [(f"b{i}", prompt(10 + i), greedy(4, user="b")) for i in range(2)]
    fcfs = make_llm(tiny_llama, max_running_requests=1)
    assert drive(fcfs, flood + trickle)[0] == ["a0", "a1", "a2", "a3", "a4", "b0", "b1"]
    llm = make_llm(tiny_llama, max_running_requests=1, scheduling_policy="fair", fair_weights="b=2")
    order, _ = drive(llm, flood + trickle)
    # b has twice a's share: after a0, b's counter (prefill 5 + 3 decode x 2 = 11, halved) stays below a's (11).
    assert order == ["a0", "b0", "b1", "a1", "a2", "a3", "a4"]
    # VTC: each prefill token 1, each decode token 2 (3 decode rows after the prefill's token), over the weight.
    assert llm.engine.scheduler.policy.counters == {"a": 5 * 11.0, "b": 2 * 11.0 / 2}


def test_policy_options_are_checked(tiny_llama, tmp_path):
    from tandem.config import EngineConfig
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model=tiny_llama, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority_aging"):
        EngineConfig(model=tiny_llama, priority_aging=0)
    with pytest.raises(ValueError, match="fair_weights"):
        parse_weights("a=2,b")
    assert parse_weights(" a=2, b=0.5 ") == {"a": 2.0, "b": 0.5}
    path = tmp_path / "weights"
    path.write_text("# shares\na=2  # the paying one\n\nb=0.5, c=3\n")
    assert parse_weights(f"@{path}") == {"a": 2.0, "b": 0.5, "c": 3.0}
    with pytest.raises(ValueError, match="cannot read"):
        parse_weights(f"@{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="priority"):
        greedy(1, priority=1.5)


@pytest.fixture
def batches(monkeypatch):
    """Every picked batch as (prefill requests, decode requests)."""
    from tandem.scheduler import loops
    seen: list[tuple[list, list]] = []

    def recording(s):
        b = loops_pick(s)
        if b is not None:
            seen.append((b.reqs[b.num_decode:], b.reqs[:b.num_decode]))
        return b
    loops_pick = loops.pick_batch
    monkeypatch.setattr(loops, "pick_batch", recording)
    return seen


@pytest.mark.parametrize("loop", ["overlap", "serial"])
def test_a_high_priority_prefill_runs_in_a_step_of_its_own_rank(tiny_llama, make_llm, batches, loop):
    # Two low-priority streams decode and a low-priority prompt waits when "high" arrives: high's prefill step
    # carries none of them (their decode rows and the waiting prompt's chunk wait one step), and none of them
    # changes its tokens.
    llm = make_llm(tiny_llama, max_running_requests=4, scheduling_policy="priority")
    lows = [(f"low{i}", prompt(i), greedy(16, priority=3)) for i in range(2)]
    alone = {label: drive(llm, [(label, ids, p)], loop=loop)[1][label] for label, ids, p in lows}
    batches.clear()
    arrivals = {4: [("high", prompt(5), greedy(4, priority=0)), ("late", prompt(6), greedy(4, priority=3))]}
    order, tokens = drive(llm, lows, arrivals, loop)
    high_steps = [(pre, dec) for pre, dec in batches if any(r.params.priority == 0 for r in pre)]
    assert len(high_steps) == 1
    pre, dec = high_steps[0]
    assert all(r.params.priority == 0 for r in pre + dec)
    assert order.index("high") < order.index("late")
    assert {label: tokens[label] for label in alone} == alone


def test_fair_takes_rows_back_from_a_tenant_over_its_share(tiny_llama, make_llm):
    # Tenant a fills all 4 rows before b arrives: under fair, b retracts one of a's requests at once (a keeps
    # its share, 2 of 4 rows, so b's second request waits) and finishes first; a's tokens are those it gives
    # alone. Under fcfs b waits for an a to finish.
    flood = [(f"a{i}", prompt(i), greedy(24, user="a")) for i in range(4)]
    late = {3: [("b0", prompt(10), greedy(4, user="b")), ("b1", prompt(11), greedy(4, user="b")),
                ("b2", prompt(12), greedy(4, user="b"))]}
    fcfs = make_llm(tiny_llama, max_running_requests=4)
    order, alone = drive(fcfs, flood, late)
    assert order[:4] == ["a0", "a1", "a2", "a3"] and fcfs.engine.scheduler.retractions == 0
    llm = make_llm(tiny_llama, max_running_requests=4, scheduling_policy="fair")
    order, tokens = drive(llm, flood, late)
    assert llm.engine.scheduler.retractions == 2           # a down to its share of 2 rows, never below
    assert order[:2] == ["b0", "b1"]
    assert tokens == alone
