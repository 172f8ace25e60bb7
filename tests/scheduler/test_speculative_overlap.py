"""Speculative decoding under the overlap loop: a drafting request is picked while its previous step is in flight,
assuming that step's run is accepted whole (scheduler/speculative.py). Outputs equal speculation off where the
assumption holds and where it fails (its rows dropped, the request picked again from host truth), with stops
inside runs, aborts, retraction, the FutureMap poisoned and no leaked slot or row; and drafting steps really are
picked ahead (counted by the scheduler, never timed).
"""
from __future__ import annotations

import pytest

import tandem.scheduler.speculative as spec_mod
from tandem import LLM, SamplingParams
from tests.scheduler.test_overlap import run_script
from tests.scheduler.test_speculative import QUOTE, SPEC, Oracle, configure, greedy, outputs, pin_row_cost

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
PARAMS = [greedy(60, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=50, ignore_eos=True)]


def counters(llm) -> dict:
    s, st = llm.engine.scheduler, llm.stats()
    return {"ahead": s.spec.stats.ahead_drafts, "dropped": s.spec.stats.ahead_dropped, "syncs": st["spec_syncs"],
            "runs": sum(s.spec.stats.accepted_hist.values()), "drafted": st["spec_draft_tokens"], "accepted": st["spec_accepted_tokens"]}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_tokens=4096, max_running_requests=16, poison_future_map=True,
              speculative_config=SPEC)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain(llm):
    configure(llm, "overlap", False)
    return outputs(llm, PROMPTS, PARAMS)[0]


def run_spec(llm, monkeypatch, proposer, loop="overlap", prompts=PROMPTS, params=PARAMS):
    monkeypatch.setattr(spec_mod, "ngram_drafts", proposer)
    pin_row_cost(llm, monkeypatch)
    configure(llm, loop, True)
    before = counters(llm)
    got = outputs(llm, prompts, params)[0]            # leak-checked
    return got, delta(before, counters(llm))


def test_right_drafts_are_picked_ahead_and_hold(llm, plain, monkeypatch):
    """Drafts and bonus tokens always right: after its first, every drafting step of a request is picked while
    the one before it is in flight, and none is dropped."""
    got, c = run_spec(llm, monkeypatch, Oracle({tuple(p): o[0] for p, o in zip(PROMPTS, plain)}, wrong=0.0))
    assert got == plain
    assert c["accepted"] == c["drafted"] > 0 and c["dropped"] == 0
    assert c["ahead"] >= c["runs"] - 2 * len(PROMPTS) > 0     # the first of each request, and one near its end


@pytest.mark.parametrize("wrong", [0.3, 0.8])
def test_failed_assumptions_drop_rows_and_change_nothing(llm, plain, monkeypatch, wrong):
    """A wrong draft or bonus token: the rows picked on it are dropped, and the tokens equal plain decode."""
    got, c = run_spec(llm, monkeypatch, Oracle({tuple(p): o[0] for p, o in zip(PROMPTS, plain)}, wrong=wrong))
    assert got == plain
    assert c["ahead"] > 0 and c["dropped"] > 0 and 0 < c["accepted"] < c["drafted"]


def test_garbage_drafts_stop_picks_ahead(llm, plain, monkeypatch):
    """Runs that never hold: after its first failed pick ahead a request waits for host truth (AHEAD_MIN_HOLD)."""
    got, c = run_spec(llm, monkeypatch, Oracle({tuple(p): o[0] for p, o in zip(PROMPTS, plain)}, garbage=True))
    assert got == plain and c["drafted"] > 0 and c["accepted"] < c["drafted"] // 4
    assert c["ahead"] <= len(PROMPTS)


def test_serial_loop_never_picks_ahead(llm, plain, monkeypatch):
    got, c = run_spec(llm, monkeypatch, Oracle({tuple(p): o[0] for p, o in zip(PROMPTS, plain)}), loop="serial")
    assert got == plain and c["ahead"] == c["dropped"] == c["syncs"] == 0 and c["accepted"] > 0


def test_stops_inside_runs_picked_ahead(llm, monkeypatch):
    """Stop ids, stop strings, EOS and max_tokens inside runs whose successor is already in flight: the run is cut
    where plain decode stops, and the successor's tokens never appear."""
    eos = min(llm.engine.eos_token_ids)
    prompts = [[31, 32, 33, 34, i] for i in range(4)]
    configure(llm, "overlap", False)
    ref = llm.generate(prompts, greedy(40, ignore_eos=True), use_tqdm=False)
    params = [greedy(40, stop_token_ids=[ref[0].token_ids[17]], ignore_eos=True),
              greedy(40, stop=[ref[1].text[len(ref[1].text) * 2 // 3:len(ref[1].text) * 2 // 3 + 3]],
                     ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, max_tokens=40, min_tokens=18, logit_bias={eos: 40.0}),
              greedy(23, ignore_eos=True)]
    want = []
    for p, prm in zip(prompts, params):                 # one at a time: each decodes alone, so it drafts
        want += outputs(llm, [p], [prm])[0]
    assert [w[1] for w in want] == ["stop", "stop", "stop", "length"]
    truth = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    truth[tuple(prompts[2])] = want[2][0]
    total = {}
    for p, prm, w in zip(prompts, params, want):
        got, c = run_spec(llm, monkeypatch, Oracle(truth, wrong=0.0), prompts=[p], params=[prm])
        assert got == [w]
        total = {k: total.get(k, 0) + v for k, v in c.items()}
    assert total["ahead"] > 8


@pytest.mark.parametrize("loop", ["serial", "overlap"])
def test_retraction_and_aborts_with_failed_assumptions(tiny_llama, make_llm, monkeypatch, loop):
    """A small KV cache retracts requests while others are picked ahead; wrong drafts drop rows meanwhile; an
    abort ends only its request."""
    initial = [(f"r{i}", [9 + i] * (15 + 4 * i), greedy(40, ignore_eos=True)) for i in range(3)]
    llm = make_llm(tiny_llama, kv_cache_tokens=140, poison_future_map=True, speculative_config=SPEC)
    configure(llm, loop, False)
    plain = run_script(llm, loop, initial, {})
    truth = {tuple(ids): plain[label][0] for label, ids, _ in initial}
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle(truth, wrong=0.4))
    llm = make_llm(tiny_llama, kv_cache_tokens=140, poison_future_map=True, speculative_config=SPEC)
    pin_row_cost(llm, monkeypatch)
    configure(llm, loop, True)
    assert run_script(llm, loop, initial, {}) == plain
    s = llm.engine.scheduler
    assert s.retractions > 0 and llm.stats()["spec_accepted_tokens"] > 0
    if loop == "overlap":
        assert s.spec.stats.ahead_drafts > 0 and s.spec.stats.ahead_dropped > 0
    aborted = run_script(llm, loop, initial, {4: [("abort", "r1")]})
    toks, reason = aborted["r1"]
    assert reason == "abort" and toks == plain["r1"][0][:len(toks)]
    assert {k: v for k, v in aborted.items() if k != "r1"} == {k: v for k, v in plain.items() if k != "r1"}


def test_penalized_rows_wait_for_host_truth(llm, monkeypatch):
    """A penalized request is never picked on an assumption (its device counts cannot be undone): it drafts,
    outputs equal plain decode, and nothing is picked ahead."""
    prompts, params = [[50, 51, 52, 50, 51]], [greedy(30, ignore_eos=True, frequency_penalty=0.8)]
    configure(llm, "overlap", False)
    want = outputs(llm, prompts, params)[0]
    got, c = run_spec(llm, monkeypatch, Oracle({tuple(prompts[0]): want[0][0]}, wrong=0.2), prompts=prompts,
                      params=params)
    assert got == want and c["accepted"] > 0 and c["ahead"] == c["dropped"] == 0
    assert c["syncs"] > 0                       # its drafting steps waited for host truth before the next pick


def test_real_model_quoting_picks_ahead(monkeypatch):
    """SmolLM2 with the real n-gram proposer in the overlap loop: quoting requests (a whole quote: drafts mostly
    held; a quote cut short, the model going on past it: assumptions fail) give the tokens of speculation off,
    greedy and seeded, with most drafting steps picked ahead."""
    llm = LLM(poison_future_map=True, speculative_config=SPEC)
    pin_row_cost(llm, monkeypatch)
    try:
        chats = [[{"role": "user", "content": "Repeat this passage exactly:\n\n" + QUOTE}],
                 [{"role": "user", "content": "Repeat this passage exactly:\n\n" + QUOTE[:120]}]]
        params = [SamplingParams(temperature=0, max_tokens=64), SamplingParams(temperature=0.7, seed=5, max_tokens=48)]
        configure(llm, "overlap", False)
        plain = [o.token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        total = {}
        for chat, p, want in zip(chats, params, plain):
            configure(llm, "overlap", True)
            before = counters(llm)
            assert llm.chat([chat], [p], use_tqdm=False)[0].token_ids == want
            c = delta(before, counters(llm))
            total = {k: total.get(k, 0) + v for k, v in c.items()}
        assert total["ahead"] > total["runs"] // 2 > 0 and total["dropped"] > 0
    finally:
        llm.shutdown()


def test_data_parallel_replicas_speculate_and_change_nothing(tiny_llama):
    """dp_size 2: each replica process speculates (the real n-gram proposer, on prompts that repeat themselves);
    greedy and seeded outputs equal one engine without speculation."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [12, 13] * 9, [14, 15, 16, 17, 18] * 4]
    params = [greedy(24, ignore_eos=True), SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)] * 2
    ref = LLM(tiny_llama, scheduler="overlap")
    try:
        want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    finally:
        ref.shutdown()
    llm = LLM(tiny_llama, dp_size=2, scheduler="overlap", poison_future_map=True, speculative_config=SPEC)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        st = llm.stats()
        assert st["spec_draft_tokens"] > 0 and st["num_running"] == 0
    finally:
        llm.shutdown()
